"""Prometheus metrics of an engine replica, labelled by model and A/B arm.

Names follow vLLM / llama-server. They are Ray Serve custom metrics
(`ray.serve.metrics`), exported by every node's Ray metrics agent with Ray's
`ray_` prefix (counters also get `_total`) and Serve's own labels
(`application`, `deployment`, `replica`) next to ours: `model` (the served
model's id, as vLLM's `model_name`), `arm`, and where said `position` or
`finish_reason`. Every name below carries {model,arm}:

    ray_specray_spec_decode_num_drafts_total              drafts verified
    ray_specray_spec_decode_num_draft_tokens_total        draft tokens verified
    ray_specray_spec_decode_num_accepted_tokens_total     draft tokens accepted
    ray_specray_spec_decode_num_accepted_tokens_per_pos_total{position}
                                                          drafts with >= position+1 accepted
    ray_specray_spec_decode_num_tree_drafts_total         drafts verified as trees (draft_tree.py)
    ray_specray_spec_decode_num_tree_branches_total       their runner-up branches beside the main draft
    ray_specray_spec_decode_num_tree_accepted_branch_total{rank}
                                                          tree drafts whose accepted path lay on the branch
                                                          of this rank (0: the main draft)
    ray_specray_requests_total{finish_reason}             finished requests (stop, length, cancelled, error)
    ray_specray_prompt_tokens_total, ray_specray_generation_tokens_total
    ray_specray_time_to_first_token_seconds               histogram: arrival at the replica -> first token
    ray_specray_inter_token_latency_seconds               histogram: per request, the mean time between its
                                                          tokens after the first
    ray_specray_e2e_request_latency_seconds               histogram
    ray_specray_slots_busy, ray_specray_slots_total,
    ray_specray_slot_occupancy (busy / total), ray_specray_requests_waiting
    ray_specray_prefix_cache_queries_total                prompt tokens of finished requests
    ray_specray_prefix_cache_hits_total                   of them, found cached (vLLM's pair)
    ray_specray_prefix_cache_host_bytes,                  the prompt cache's host tier: bytes
    ray_specray_prefix_cache_host_entries                 and prefixes held in host memory

The spec-decode counters are engine-level (as vLLM's): the replica's
speculator counters, pushed as deltas from the round thread (at most once per
`flush_interval_s`, and at once when a request ends or the replica goes
idle), so they keep moving during long generations.
"""

from __future__ import annotations

import time
from typing import Any

PREFIX = "specray_"
#: histogram buckets (seconds), close to vLLM's
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                10.0, 20.0, 40.0]
ITL_BUCKETS = [0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0]


def timing_of(seq) -> dict[str, float | None]:
    """Per-request timings (seconds) from a finished Sequence: ttft (arrival at the replica -> first
    token), itl (mean time between tokens after the first), e2e (arrival -> last token), and the decode
    speed after the first token. None where the request produced too few tokens to tell."""
    t0 = getattr(seq.req, "t_arrival", None) or seq.t_submit
    t_first, t_end = seq.t_first_token, seq.t_finish or time.perf_counter()
    n = len(seq.generated)
    ttft = t_first - t0 if t_first is not None else None
    itl = (t_end - t_first) / (n - 1) if t_first is not None and n >= 2 and t_end > t_first else None
    return {"ttft_s": ttft, "itl_s": itl, "e2e_s": t_end - t0,
            "decode_tokens_per_s": 1.0 / itl if itl else None}


def replica_stages(t_start: float, t_request: float, t_admit: float | None, t_first: float | None,
                   t_finish: float | None, t_end: float, emit_s: float, emit_chunks: int,
                   to_start_s: float) -> dict[str, float | int]:
    """The replica's part of a streamed request's per-stage timing (ms; perf_counter stamps of this process):
    tokenize (generate_stream called -> engine request built), admission (-> the round that gave it a slot),
    prefill (-> first token), decode (-> last token), emit_tail (last token -> the end chunk yielded by the
    replica's event loop). They add up to replica_ms (generate_stream called -> end chunk yielded). Not
    additive: emit_mean_ms over emit_chunks (each delta chunk: round thread produced it -> event loop yielded
    it; overlaps the next rounds) and to_start_ms (-> the start chunk yielded: the ingress subtracts it from
    its wait for that chunk to price one handle round trip).

    >>> d = replica_stages(0.0, 0.001, 0.003, 0.050, 0.250, 0.2505, emit_s=0.004, emit_chunks=40, to_start_s=0.002)
    >>> d["tokenize_ms"], d["admission_ms"], d["prefill_ms"], d["decode_ms"], d["emit_tail_ms"], d["replica_ms"]
    (1.0, 2.0, 47.0, 200.0, 0.5, 250.5)
    >>> d["emit_mean_ms"], d["emit_chunks"], d["to_start_ms"]
    (0.1, 40, 2.0)
    """
    t_admit = t_request if t_admit is None else t_admit  # (never None once a round ran it)
    t_finish = t_end if t_finish is None else t_finish
    t_first = t_finish if t_first is None else t_first  # ended without a token: all of it was prefill
    ms = lambda s: round(1000.0 * s, 3)  # noqa: E731
    return {"tokenize_ms": ms(t_request - t_start), "admission_ms": ms(t_admit - t_request),
            "prefill_ms": ms(t_first - t_admit), "decode_ms": ms(t_finish - t_first),
            "emit_tail_ms": ms(t_end - t_finish), "replica_ms": ms(t_end - t_start),
            "emit_mean_ms": ms(emit_s / emit_chunks) if emit_chunks else 0.0, "emit_chunks": emit_chunks,
            "to_start_ms": ms(to_start_s)}


def spec_totals(spec_stats: dict[str, Any]) -> tuple[int, int, int, list[int]]:
    """(drafts, draft tokens, accepted tokens, accepted per position) summed over a chain's speculators
    (values: SpeculatorStats or their to_dict())."""
    drafts = tokens = accepted = 0
    per_pos: list[int] = []

    def get(s, name):
        return s[name] if isinstance(s, dict) else getattr(s, name)

    for s in spec_stats.values():
        drafts += get(s, "drafts_chosen")
        tokens += get(s, "tokens_generated")
        accepted += get(s, "tokens_accepted")
        pp = list(get(s, "accepted_per_pos"))
        per_pos.extend([0] * (len(pp) - len(per_pos)))
        for i, v in enumerate(pp):
            per_pos[i] += v
    return drafts, tokens, accepted, per_pos


class EngineMetrics:
    """The replica's metrics for one arm. Called on the router's round thread (`request_finished`,
    `after_round`); `backend` is the module with Counter / Gauge / Histogram (ray.serve.metrics)."""

    def __init__(self, arm: str, slots: int, flush_interval_s: float = 1.0, backend=None, model: str = "") -> None:
        if backend is None:
            from ray.serve import metrics as backend
        self.arm = arm
        self.tags = {"model": model, "arm": arm}
        self.slots = slots
        self.flush_interval_s = flush_interval_s
        C, G, H = backend.Counter, backend.Gauge, backend.Histogram
        arm_tag = ("model", "arm")
        p = PREFIX
        self.drafts = C(p + "spec_decode_num_drafts", "drafts verified by the target", tag_keys=arm_tag)
        self.draft_tokens = C(p + "spec_decode_num_draft_tokens", "draft tokens verified", tag_keys=arm_tag)
        self.accepted = C(p + "spec_decode_num_accepted_tokens", "draft tokens accepted", tag_keys=arm_tag)
        self.per_pos = C(p + "spec_decode_num_accepted_tokens_per_pos",
                         "drafts with at least position+1 tokens accepted", tag_keys=("model", "arm", "position"))
        self.tree_drafts = C(p + "spec_decode_num_tree_drafts", "drafts verified as trees", tag_keys=arm_tag)
        self.tree_branches = C(p + "spec_decode_num_tree_branches", "runner-up branches of tree drafts",
                               tag_keys=arm_tag)
        self.tree_ranks = C(p + "spec_decode_num_tree_accepted_branch",
                            "tree drafts by the rank of the accepted branch (0: the main draft)",
                            tag_keys=("model", "arm", "rank"))
        self.requests = C(p + "requests", "finished requests by finish reason",
                          tag_keys=("model", "arm", "finish_reason"))
        self.prompt_tokens = C(p + "prompt_tokens", "prompt tokens of finished requests", tag_keys=arm_tag)
        self.generation_tokens = C(p + "generation_tokens", "tokens generated", tag_keys=arm_tag)
        self.ttft = H(p + "time_to_first_token_seconds", "arrival at the replica -> first token",
                      boundaries=TTFT_BUCKETS, tag_keys=arm_tag)
        self.itl = H(p + "inter_token_latency_seconds", "per request: mean time between tokens after the first",
                     boundaries=ITL_BUCKETS, tag_keys=arm_tag)
        self.e2e = H(p + "e2e_request_latency_seconds", "arrival at the replica -> last token",
                     boundaries=E2E_BUCKETS, tag_keys=arm_tag)
        self.slots_busy = G(p + "slots_busy", "slots decoding or prefilling", tag_keys=arm_tag)
        self.slots_total = G(p + "slots_total", "slots of the replica", tag_keys=arm_tag)
        self.occupancy = G(p + "slot_occupancy", "busy slots / slots", tag_keys=arm_tag)
        self.waiting = G(p + "requests_waiting", "requests queued for a slot", tag_keys=arm_tag)
        self.cache_queries = C(p + "prefix_cache_queries", "prompt tokens of finished requests", tag_keys=arm_tag)
        self.cache_hits = C(p + "prefix_cache_hits", "prompt tokens found in the prefix cache", tag_keys=arm_tag)
        self.host_bytes = G(p + "prefix_cache_host_bytes", "bytes of prefixes held in host memory", tag_keys=arm_tag)
        self.host_entries = G(p + "prefix_cache_host_entries", "prefixes held in host memory", tag_keys=arm_tag)
        self.slots_total.set(slots, tags=self.tags)
        self._seen = (0, 0, 0, [])  # spec totals already pushed
        self._seen_trees = (0, 0, [])  # tree totals already pushed
        self._last_flush = 0.0
        self._finished_since_flush = False

    def request_finished(self, seq, reason: str | None = None) -> None:
        reason = reason or seq.finish_reason or "unknown"
        self.requests.inc(1, tags=self.tags | {"finish_reason": reason})
        self.prompt_tokens.inc(len(seq.req.prompt_tokens), tags=self.tags)
        self.cache_queries.inc(len(seq.req.prompt_tokens), tags=self.tags)
        if seq.cached_tokens:
            self.cache_hits.inc(seq.cached_tokens, tags=self.tags)
        if seq.generated:
            self.generation_tokens.inc(len(seq.generated), tags=self.tags)
        t = timing_of(seq)
        if t["ttft_s"] is not None:
            self.ttft.observe(t["ttft_s"], tags=self.tags)
        if t["itl_s"] is not None:
            self.itl.observe(t["itl_s"], tags=self.tags)
        self.e2e.observe(t["e2e_s"], tags=self.tags)
        self._finished_since_flush = True

    def after_round(self, spec_stats: dict[str, Any], busy: int, waiting: int, idle: bool = False,
                    host: dict | None = None, trees: dict | None = None) -> None:
        """Push the spec-decode deltas and slot gauges, rate-limited (forced after a request ended or when
        the replica went idle, so the figures are exact once the traffic stops). `host`: the prompt cache's
        host tier figures (HostTier.to_dict); `trees`: the tree counters per speculator (TreeCounters.to_dict)."""
        now = time.monotonic()
        if not (idle or self._finished_since_flush or now - self._last_flush >= self.flush_interval_s):
            return
        self._last_flush = now
        self._finished_since_flush = False
        self.flush_spec(spec_stats)
        if trees is not None:
            self.flush_trees(trees)
        self.slots_total.set(self.slots, tags=self.tags)  # (set with the others: a gauge set only once at start
        self.slots_busy.set(busy, tags=self.tags)         # was seen exported as 0)
        self.waiting.set(waiting, tags=self.tags)
        self.occupancy.set(busy / self.slots if self.slots else 0.0, tags=self.tags)
        if host is not None:
            self.host_bytes.set(host["bytes"], tags=self.tags)
            self.host_entries.set(host["entries"], tags=self.tags)

    def flush_trees(self, trees: dict[str, dict]) -> None:
        """Push the tree counters' deltas (summed over speculators; rebased where they went back)."""
        drafts = sum(c["drafts"] for c in trees.values())
        branches = sum(c["branches"] for c in trees.values())
        ranks: list[int] = []
        for c in trees.values():
            for i, v in enumerate(c["accepted_by_rank"]):
                ranks.extend([0] * (i + 1 - len(ranks)))
                ranks[i] += v
        d0, b0, r0 = self._seen_trees
        if drafts < d0 or branches < b0:
            d0, b0, r0 = 0, 0, []
        if drafts > d0:
            self.tree_drafts.inc(drafts - d0, tags=self.tags)
        if branches > b0:
            self.tree_branches.inc(branches - b0, tags=self.tags)
        for i, v in enumerate(ranks):
            old = r0[i] if i < len(r0) else 0
            if v > old:
                self.tree_ranks.inc(v - old, tags=self.tags | {"rank": str(i)})
        self._seen_trees = (drafts, branches, ranks)

    def flush_spec(self, spec_stats: dict[str, Any]) -> None:
        drafts, tokens, accepted, per_pos = spec_totals(spec_stats)
        d0, t0, a0, p0 = self._seen
        if drafts < d0 or tokens < t0 or accepted < a0:  # counters were reset (speculators rebuilt): rebase
            d0 = t0 = a0 = 0
            p0 = []
        for counter, new, old in ((self.drafts, drafts, d0), (self.draft_tokens, tokens, t0),
                                  (self.accepted, accepted, a0)):
            if new > old:
                counter.inc(new - old, tags=self.tags)
        for i, v in enumerate(per_pos):
            old = p0[i] if i < len(p0) else 0
            if v > old:
                self.per_pos.inc(v - old, tags=self.tags | {"position": str(i)})
        self._seen = (drafts, tokens, accepted, per_pos)
