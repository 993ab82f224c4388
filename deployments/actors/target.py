"""The target actor and the router-side proxy that talks to it.

`TargetService` holds the target model + context + `TargetRunner` (logits
never leave it). `TargetActor` is the same class as a Ray actor. One round =
ONE call: `step(items, starts, releases)` first frees the slots the router
released since the last round, registers the sequences it admitted this round,
then decodes and verifies every slot's rows in one batch and returns token
ids only.

`RemoteTarget` is what the router's Scheduler sees in distributed mode: it has
TargetRunner's `start/step/release` interface, buffers start/release calls
and piggybacks them on the next `step`, so a round costs one actor hop.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import ray

from specray.deployments import heap
from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import HiddenRows
from specray.engine.sampling import SamplingParams
from specray.engine.target import StepItem, StepOutput, TargetRunner
from specray.native import decode_threads


log = logging.getLogger(__name__)

#: the Ray concurrency group of the target actor's calls that use its context
DECODE_GROUP = "context"


class TargetService:
    """Model + Context + TargetRunner, callable locally or as a Ray actor."""

    def __init__(self, engine_config: dict | EngineConfig, freeze_gc: bool = False) -> None:
        """`freeze_gc`: as an actor (a process of its own), freeze what start-up left out of the garbage
        collector once the target is up (ServeConfig.freeze_gc, deployments/heap.py)."""
        from specray.deployments.builder import open_target, target_runner  # llama.cpp stays out of module import

        from specray.deployments.builder import usable_cpus

        # the actor decides its thread count on its own node (a cluster's nodes differ from the driver's)
        self.config = EngineConfig.model_validate(engine_config).with_threads(True, usable_cpus())
        self.model, self.ctx = open_target(self.config)
        self.runner, self.memory = target_runner(self.config, self.model, self.ctx)
        self.hidden_transport = None  # hidden rows for the companion's mtp / eagle3 heads
        if self.config.hidden.enabled:
            from specray.native.hidden import HiddenOutput
            from specray.native.hidden_heads import target_taps

            from specray.deployments.actors.row_transport import make_transport

            self.runner.hidden_out = HiddenOutput(self.ctx, target_taps(self.config))
            self.hidden_transport = make_transport(self.config.hidden.transport,
                                                   inline_below=self.config.hidden.inline_below_bytes)
        self._lock = threading.Lock()  # the context is not thread-safe; ping/counters don't need it
        self._wake = threading.Event()  # ends a compiled graph's park (target_channel.py)
        self.calls = 0
        heap.watch()
        if freeze_gc:
            heap.freeze_startup()

    def info(self) -> dict:
        from specray.deployments.builder import usable_cpus

        return {
            "n_ctx": self.ctx.n_ctx,
            "n_ctx_seq": getattr(self.ctx, "n_ctx_seq", self.ctx.n_ctx),
            "kv_unified": getattr(self.ctx, "kv_unified", True),
            "n_batch": self.ctx.n_batch,
            "n_seq_max": self.ctx.n_seq_max,
            "n_vocab": self.model.n_vocab,
            "threads": self.config.threads,
            "cpus": usable_cpus(),  # this node's, for the target hop's auto choice (target_channel.py)
            "model": self.config.model,
            "model_description": self.model.description,
            "memory": self.memory.to_dict(),  # kind and rollback mode (engine/rollback.py)
            "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "placement_group_id": ray.get_runtime_context().get_placement_group_id() if ray.is_initialized() else None,
            # the GPUs Ray gave this actor (target_gpus; CUDA_VISIBLE_DEVICES follows them) and the layers on them
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else [],
            "n_gpu_layers": self.model.n_gpu_layers,
            "gpu_split": {k: v for k, v in self.model.gpu_split.items() if not k.startswith("_")},
            "hidden_transport": self.hidden_transport.info() if self.hidden_transport is not None else None,
        }

    def ping(self) -> str:
        return "ok"

    @ray.method(concurrency_group=DECODE_GROUP)
    def calibrate_cost(self) -> dict:
        with self._lock:
            return self.runner.calibrate_cost()

    @ray.method(concurrency_group=DECODE_GROUP)
    def start_many(self, starts: list[tuple]) -> None:
        with self._lock:
            for start in starts:
                self.runner.start(*start)

    @ray.method(concurrency_group=DECODE_GROUP)
    def release(self, seq_ids: list[int]) -> None:
        with self._lock:
            for s in seq_ids:
                self.runner.release(s)

    @ray.method(concurrency_group=DECODE_GROUP)
    def step(
        self,
        items: list[StepItem],
        ops: list[tuple] = (),
        hidden_acks: list = (),
    ) -> tuple[StepOutput, float]:
        """The slot operations the router buffered since the last round, in its order (("release", seq_id, keep),
        ("start", seq_id, params, prompt, n_keep, copy_from, restore, share), ("stash", seq_id, key), ("drop", keys):
        TargetRunner's methods), then one round. Returns (output, seconds spent in here). Hidden rows
        (StepOutput.hidden) leave as a transport handle; hidden_acks free the transport's buffers."""
        t0 = time.perf_counter()
        with self._lock:
            if hidden_acks and self.hidden_transport is not None:
                self.hidden_transport.acknowledge(hidden_acks)
            for op in ops:
                SLOT_OPS[op[0]](self.runner, *op[1:])
            # (an empty step, a flush, leaves the host tier's report for the next round's output)
            out = self.runner.step(items) if items else StepOutput([], 0.0, 0, 0)
            if out.hidden is not None and self.hidden_transport is not None:
                out.hidden = self.hidden_transport.export(out.hidden)
            self.calls += 1
        return out, time.perf_counter() - t0

    def channel(self, msg: tuple):
        """The one method of the compiled graph (target_channel.py), on Ray's compiled-graph thread, which then
        does every decode: ("step", items, ops, acks) | ("calibrate",) | ("park",). A park holds the
        thread in a plain wait until `wake`: between executions Ray 2.60's graph loop polls its input channel,
        a whole core while the router is idle."""
        op, args = msg[0], msg[1:]
        if op == "step":
            return self.step(*args)
        if op == "calibrate":
            return self.calibrate_cost()
        if op == "park":
            self._wake.wait()
            self._wake.clear()
            return None
        raise ValueError(f"unknown target channel op {op!r}")

    def wake(self) -> None:
        """Ends a park (default group: it runs beside the parked graph thread)."""
        self._wake.set()

    def counters(self) -> dict:
        r = self.runner
        with self._lock:  # between rounds: the KV cache is consistent
            kv = [self.ctx.seq_pos_max(i) + 1 for i in range(self.config.slots)]  # not the tree branches' ids
        return {
            "rounds": r.rounds,
            "multi_seq_decodes": r.multi_seq_decodes,
            "max_seqs_in_decode": r.max_seqs_in_decode,
            "step_decodes": r.step_decodes,
            "step_decode_seqs": r.step_decode_seqs,
            "decodes": self.ctx.n_decodes,
            "flash_attn": self.ctx.flash_attn,
            "calls": self.calls,
            # live threads of this process that have decoded: 1, or OpenMP slows every decode
            "decode_threads": len(decode_threads.live()),
            "decode_tids": decode_threads.native_ids(),  # bench/server_cpu.py
            "sessions": len(r.sessions),
            # KV cells per slot (0 = empty): a finished or cancelled sequence leaves none
            "kv_cells": kv,
            "hidden_rows": r.hidden_rows,
            "hidden_transport": self.hidden_transport.info() if self.hidden_transport is not None else None,
            # shape-stable verifies: the buckets this actor pads to (None: off) and the pad rows decoded so far
            "verify_buckets": list(r.verify_buckets) if r.verify_buckets is not None else None,
            "pad_rows": r.pad_rows,
            "tile_pad_rows": r.tile_pad_rows,
            "rollback": r.rollback.stats.to_dict(),  # a recurrent target's saves, restores and replays
            "gc": heap.watch().snapshot(),  # this process's collections and the objects frozen at start
        }


#: the actor; options (resources, placement, max_concurrency) are set by the router
# the context's calls run in one concurrency group of one thread, so one thread does every decode (llama.cpp's
# OpenMP pools are per calling thread: native/decode_threads.py); ping, info and counters run beside it in the
# default group (max_concurrency, set at launch), so a health check never waits behind a round
TargetActor = ray.remote(concurrency_groups={DECODE_GROUP: 1})(TargetService)


@dataclass
class HopStats:
    """Router-side wall time of a step call minus the time the actor spent in it."""

    calls: int = 0
    total_seconds: float = 0.0
    min_seconds: float = float("inf")

    def __post_init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=512)

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.total_seconds += seconds
        self.min_seconds = min(self.min_seconds, seconds)
        self.recent.append(seconds)

    def to_dict(self) -> dict:
        rec = sorted(self.recent)
        return {
            "calls": self.calls,
            "mean_ms": 1000 * self.total_seconds / self.calls if self.calls else 0.0,
            "p50_ms_recent": 1000 * rec[len(rec) // 2] if rec else 0.0,
            "min_ms": 1000 * self.min_seconds if self.calls else 0.0,
            # oldest first: a client diffing `calls` takes the last n for its own window's percentiles
            "recent_ms": [round(1000 * s, 4) for s in self.recent],
        }


#: the router's buffered slot operations, by name, as the actor applies them (RemoteTarget buffers them)
SLOT_OPS = {"release": TargetRunner.release, "start": TargetRunner.start, "stash": TargetRunner.stash,
            "drop": TargetRunner.drop_stash}


class RemoteTarget:
    """TargetRunner's interface over the target actor: one actor call per round.

    `epoch` is the generation of the actor (ActorSupervisor) it talks to."""

    def __init__(self, actor, epoch: int = 1, timeout_s: float | None = None, hop: str = "actor") -> None:
        self.actor = actor
        self.epoch = epoch
        self.timeout_s = timeout_s  # a step that takes longer counts as a hung actor (GetTimeoutError)
        self.mode = hop  # "actor": one actor call a round; "compiled": a Ray compiled graph (target_channel.py)
        self.channel = self._open_channel(actor)
        # slot operations for the next step, in order: ("release", slot, KV cells it keeps for the prompt cache),
        # ("start", TargetRunner.start's arguments...), ("stash", slot, key), ("drop", keys)
        self._ops: list[tuple] = []
        self._hidden_acks: list = []  # CUDA-IPC hidden-row buffers the companion is done with
        self._launched: tuple | None = None  # (ref, launch time, rows) of a round launched, not yet collected
        self.hop = HopStats()

    def _open_channel(self, actor):
        if self.mode != "compiled":
            return None
        from .target_channel import CompiledChannel

        return CompiledChannel(actor, self.timeout_s)

    def reset(self, actor, epoch: int) -> None:
        """Talk to a new actor from now on; what was buffered for the old one is dropped
        (the new actor's KV cache is empty). If its graph cannot be compiled this raises, and the proxy
        stays on the old epoch (the caller marks the new actor down)."""
        self.close()
        self.channel = self._open_channel(actor)
        self.actor = actor
        self.epoch = epoch
        self._ops = []
        self._hidden_acks = []
        self._launched = None

    def close(self) -> None:
        """Tear down the compiled graph, if any (before the actor is killed or replaced)."""
        channel, self.channel = self.channel, None
        if channel is not None:
            try:
                channel.close()
            except Exception as e:  # the actor is gone either way; a new graph goes to the new one
                log.warning("tearing down the target's compiled graph failed: %s", e)

    def calibrate(self) -> dict:
        """The target's cost table (TargetRunner.calibrate_cost), on the thread that will do the rounds."""
        if self.channel is not None:
            return self.channel.call(("calibrate",))
        return ray.get(self.actor.calibrate_cost.remote(), timeout=self.timeout_s)

    def park(self) -> None:
        """The router goes idle (compiled graph: free the core its actor thread would poll with)."""
        if self.channel is not None:
            self.channel.park()

    def ack_hidden(self, acks: list) -> None:
        """Hidden-row buffers the companion is done with; they go to the target with the next step."""
        self._hidden_acks.extend(acks)

    def pending(self) -> bool:
        return bool(self._ops)

    @property
    def pending_releases(self) -> int:
        """Slot releases buffered for the next step (/v1/stats `pending_releases`)."""
        return sum(op[0] == "release" for op in self._ops)

    def start(self, seq_id: int, params: SamplingParams, prompt: np.ndarray, n_keep: int = 0,
              copy_from: int | None = None, restore: int | None = None,
              share: tuple[int, int] | None = None) -> None:
        self._ops.append(("start", seq_id, params, np.asarray(prompt, dtype=np.int32), n_keep, copy_from, restore,
                          share))

    def release(self, seq_id: int, keep: int = 0) -> None:
        # after a start of the same slot not yet sent (a sequence cancelled before its first round): the start
        # still goes first, so the cells kept are those it set up (copied or restored ones too)
        self._ops.append(("release", seq_id, keep))

    def stash(self, seq_id: int, key: int) -> None:
        """Applied in order with the next step; the bytes saved come back in its StepOutput.stashed."""
        self._ops.append(("stash", seq_id, key))

    def drop_stash(self, keys: list[int]) -> None:
        if keys:
            self._ops.append(("drop", list(keys)))

    def step(self, items: list[StepItem]) -> StepOutput:
        self.launch(items)
        return self.collect()

    def launch(self, items: list[StepItem]) -> None:
        """`step`'s first half: the round (and the slot operations buffered before it) sent to the actor, not
        waited for; `collect` reads its answer. The router does other work between the two (overlapped rounds):
        nothing of this object may be called meanwhile."""
        if self._launched is not None:
            raise RuntimeError("a launched round was not collected")
        ops, self._ops = self._ops, []
        acks, self._hidden_acks = self._hidden_acks, []
        t0 = time.perf_counter()
        rows = sum(len(it.tokens) for it in items)
        if self.channel is not None:
            ref = self.channel.submit(("step", items, ops, acks))
        else:
            ref = self.actor.step.remote(items, ops, acks) if acks else self.actor.step.remote(items, ops)
        self._launched = (ref, t0, rows)

    def collect(self) -> StepOutput:
        """The launched round's output. The hop's time counts from the launch: where the router's work between
        the two outlasts the actor's, that work is in it too."""
        launched, self._launched = self._launched, None
        if launched is None:
            raise RuntimeError("collect without launch")
        ref, t0, rows = launched
        if self.channel is not None:
            out, inside = self.channel.answer(ref, t0, rows)
            self.channel.wait.observe(rows, inside)
            if isinstance(out.hidden, HiddenRows):
                # rows sent by value arrive as views of the channel's buffer, and the companion's proxy keeps
                # them for up to FLUSH_RECORDS rounds: held, they block the channel's next answer (every
                # round then timed out); copied, the buffer is free again
                out.hidden = out.hidden.owned()
        else:
            out, inside = ray.get(ref, timeout=self.timeout_s)
        self.hop.add(max(0.0, time.perf_counter() - t0 - inside))
        return out

    def hop_stats(self) -> dict:
        """/v1/stats `hop`: the router-side time of a round call outside the actor, and how it travels."""
        return self.hop.to_dict() | {"mode": self.mode} | (self.channel.info() if self.channel is not None else {})

    def flush(self) -> None:
        """Apply buffered releases now (e.g. when the router goes idle)."""
        if self._ops:
            self.step([])
