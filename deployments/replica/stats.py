"""What a replica reports in /v1/stats: scheduler, chain, cost model, reliability, target and companion.

`round_snapshot` runs on the round thread between rounds (the scheduler is
not thread-safe); `actor_counters` is read afterwards from the caller's
thread (actor calls must not stall the rounds).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

from specray.deployments import heap
from specray.deployments.actors.supervisor import UP, short_error
from specray.engine.round_stages import breakdown
from specray.native import decode_threads

log = logging.getLogger("specray.router")


def process_rss() -> int | None:
    """Resident set size of this process in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def round_snapshot(core) -> dict:
    """Counters of a RouterCore (round thread only)."""
    parts, s = core.parts, core.scheduler
    policy = s.policy.snapshot()
    d = {
        "mode": core.mode,
        "slots": parts.config.slots,
        "n_ctx": parts.n_ctx,
        "n_ctx_seq": parts.n_ctx_seq,
        "active": len(s.active),
        "queued": len(s.queue),
        "free_slots": len(s.free_slots),
        "reserved_cells": s.reserved,
        # the prefix cache (engine/prefix_cache.py): idle slots' KV kept for later prompts with the same prefix
        # (cached_cells: per slot, 0 if none), copies of other slots' cells, waits, the pool's cells in use
        # counting shared ones once, and the host tier (entries, bytes, saves, restores, evictions)
        "prompt_cache": s.prefix_cache.stats() | {
            "cached_cells": [len(c.tokens) if (c := s.prefix_cache.idle.slots.get(i)) else 0
                             for i in range(parts.config.slots)]},
        "streams": len(core.slots.streams),
        "scheduler": asdict(s.stats),
        # the round's time by stage, host time per round and per decoding sequence (engine/round_stages.py), each
        # speculator's look-up cost, and the look-ups the gate skipped (engine/policy/lookup_gate.py)
        "round_stages": breakdown(s.stats.stage_seconds, s.stats.rounds, s.stats.seq_rounds) | {
            "speculator_ms_per_ask": policy["speculator_ms_per_ask"], "lookups_skipped": policy["lookups_skipped"]},
        # what the planner prices as host work (engine/policy/host_cost.py)
        "host_cost": policy["host_cost"],
        # a recurrent or hybrid target's rollback mode, and what the planner prices a checkpoint draft at
        "target_memory": s.memory.to_dict() | {"rollback_price": policy["rollback_price"]},
        "chain": s.config.chain.label,
        "disabled_speculators": sorted(s.disabled_speculators),
        # the look-up parameters tuning chose, per speculator and sequence class (ChainConfig.tune)
        "tuning": policy["tuning"],
        # each speculator's acceptance estimate and calibration, and model speculators' exploring budgets
        "policy": {k: policy[k] for k in ("estimates", "model_explore_budget_s")},
        # draft trees (engine/policy/trees.py): rounds that sent one, per speculator the trees, their branches,
        # the accepted branch's rank, and each speculator's learnt branch factor
        "trees": policy["trees"],
        "speculators": {k: asdict(v) for k, v in parts.chain.stats().items()},
        "cost_table": policy["cost_table"],
        "attention_ns_per_token_cell": policy["attention_ns_per_token_cell"],
        # the same at a long context in a decode of the attention kernel's tile, and of half as many rows
        # (engine/tile_pads.py; 0: no tile)
        "tile_attention_ns_per_token_cell": policy["tile_attention_ns_per_token_cell"],
        "subtile_attention_ns_per_token_cell": policy["subtile_attention_ns_per_token_cell"],
        "round_failures": core.rel.round_failures,
        "reliability": asdict(core.rel),
        "last_error": core.faults.last_error,
        # the garbage collector's collections in this process by generation, their time, the objects frozen at
        # start (deployments/heap.py)
        "process": {"pid": os.getpid(), "rss_bytes": process_rss(), "gc": heap.watch().snapshot()},
    }
    if parts.runner is not None:
        r = parts.runner
        d["target"] = {
            "where": "in-process",
            "threads": parts.config.threads,
            "flash_attn": parts.ctx.flash_attn,  # as the context was made (EngineConfig.flash_attn_on)
            # live threads of this process that have decoded: 1, or OpenMP slows every decode
            # (native/decode_threads.py)
            "decode_threads": len(decode_threads.live()),
            "decode_tids": decode_threads.native_ids(),  # bench/server_cpu.py
            "rounds": r.rounds,
            "multi_seq_decodes": r.multi_seq_decodes,
            "max_seqs_in_decode": r.max_seqs_in_decode,
            "step_decodes": r.step_decodes,
            "step_decode_seqs": r.step_decode_seqs,
            # KV cells per slot (0 = empty): a finished or cancelled sequence leaves none but what the prompt
            # cache keeps (prompt_cache.cached_cells)
            "kv_cells": [parts.ctx.seq_pos_max(i) + 1 for i in range(parts.config.slots)],
        }
    if parts.draft_model is not None:  # distributed: placement.companion.draft (actors/launch.py)
        d["draft"] = {"where": "in-process"} | parts.draft_model.effective_settings()
    if parts.remote is not None:
        d["hop"] = parts.remote.hop_stats()
        d["placement"] = core.placement
        d["pending_releases"] = parts.remote.pending_releases
    return d


def actor_counters(actors) -> dict:
    """The target and companion actors' own counters (caller's thread; a down actor says so)."""
    import ray

    target = {"where": "actor"} | actors.target.snapshot()
    if actors.target.state == UP:
        try:
            target |= ray.get(actors.target.handle.counters.remote(), timeout=10)
        except Exception as e:
            target["counters_error"] = short_error(e)
    return {"target": target, "companion": actors.companion.snapshot() | actors.companion.counters()}


def observe_round(core, idle: bool) -> None:
    """Tell the metrics observer how the round went (never stops the rounds)."""
    obs = core.slots.observer
    if obs is None:
        return
    s = core.scheduler
    try:
        obs.after_round(core.chain.stats(), len(s.active), len(s.queue), idle, s.prefix_cache.host.to_dict(),
                        s.policy.trees.counter_dicts())
    except Exception:
        log.exception("metrics update failed")
