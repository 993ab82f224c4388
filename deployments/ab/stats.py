"""Per-arm figures for GET /v1/stats: request records kept by the ingress, engine counters of the replicas.

The ingress sees every request of every arm, whichever engine replica served
it (and whether that replica has since been scaled away), so it keeps the
per-request records: token counts, speculation counters and the timings the
replica measured (TTFT from arrival at the replica, mean inter-token latency,
end to end). They are kept as columns (compact JSON), the newest
`max_records` per arm; the totals count every request. Streamed requests' per-stage
timings (ms, http/timing.py) are averaged in `stages_ms`. The engine counters
(slots, rounds, speculators) come from every live replica of the arm
(`DeploymentHandle.broadcast`) and are summed here.

`specray ab-report` reads this shape (`arms.NAME.records`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from specray.deployments.replica.metrics import spec_totals

#: per-request columns of `arms.NAME.records`
RECORD_FIELDS = ("t", "prompt_tokens", "completion_tokens", "ttft_s", "itl_s", "e2e_s", "drafts", "drafted",
                 "accepted")
#: streamed requests' stages (ms, http/timing.py) averaged in `arms.NAME.stages_ms` (proxy: only the
#: client sees it)
STAGE_FIELDS = ("ingress_parse_ms", "handle_ms", "tokenize_ms", "admission_ms", "prefill_ms", "decode_ms",
                "emit_tail_ms", "sse_tail_ms", "ingress_ms", "emit_mean_ms", "sse_mean_ms", "handle_first_ms")
TOTAL_FIELDS = ("requests", "errors", "prompt_tokens", "completion_tokens", "drafts", "draft_tokens",
                "accepted_tokens")
#: direct writes (deployments/http/socket_sink.py), summed over streams that had a SocketSink: `streams`, those
#: the round thread wrote to (`armed`), chunks it wrote, chunks the socket took only in part
DIRECT_FIELDS = ("streams", "armed", "chunks", "partial")


def ratios(d: dict) -> dict:
    """acceptance_rate and mean_acceptance_length (1 + accepted / drafts) from summed counters."""
    return {"acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "mean_acceptance_length": 1.0 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 1.0}


class ArmRecords:
    """Requests one arm served, as seen by one ingress replica."""

    def __init__(self, max_records: int) -> None:
        self.totals: dict[str, int] = dict.fromkeys(TOTAL_FIELDS, 0)
        self.finish_reasons: dict[str, int] = {}
        self.error_statuses: dict[str, int] = {}
        self.cols: dict[str, deque] = {f: deque(maxlen=max_records) for f in RECORD_FIELDS}
        self.stage_requests = 0
        self.stage_sums: dict[str, float] = {}
        self.direct: dict[str, int] = dict.fromkeys(DIRECT_FIELDS, 0)

    def add(self, result: dict) -> None:
        """A finished request: the replica's end chunk (or non-streamed result) with usage, speculative,
        finish_reason and timing."""
        usage, spec = result.get("usage") or {}, result.get("speculative") or {}
        timing = result.get("timing") or {}
        t = self.totals
        t["requests"] += 1
        t["prompt_tokens"] += usage.get("prompt_tokens", 0)
        t["completion_tokens"] += usage.get("completion_tokens", 0)
        t["drafts"] += spec.get("drafts", 0)
        t["draft_tokens"] += spec.get("drafted_tokens", 0)
        t["accepted_tokens"] += spec.get("accepted_tokens", 0)
        reason = result.get("finish_reason") or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        row = {"t": round(time.time(), 3), "prompt_tokens": usage.get("prompt_tokens", 0),
               "completion_tokens": usage.get("completion_tokens", 0), "ttft_s": timing.get("ttft_s"),
               "itl_s": timing.get("itl_s"), "e2e_s": timing.get("e2e_s"), "drafts": spec.get("drafts", 0),
               "drafted": spec.get("drafted_tokens", 0), "accepted": spec.get("accepted_tokens", 0)}
        for k, v in row.items():
            self.cols[k].append(v)

    def add_stages(self, stages: dict) -> None:
        """A finished stream's per-stage timing (http/timing.py): summed, for the means in `stages_ms`."""
        self.stage_requests += 1
        sums = self.stage_sums
        for k in STAGE_FIELDS:
            v = stages.get(k)
            if v is not None:
                sums[k] = sums.get(k, 0.0) + v

    def add_direct(self, summary: dict) -> None:
        """A finished stream's SocketSink.summary()."""
        d = self.direct
        d["streams"] += 1
        d["armed"] += 1 if summary.get("arms") else 0
        d["chunks"] += summary.get("chunks", 0)
        d["partial"] += summary.get("partial", 0)

    def add_error(self, status: int) -> None:
        self.totals["errors"] += 1
        self.error_statuses[str(status)] = self.error_statuses.get(str(status), 0) + 1

    def snapshot(self) -> dict:
        return {**self.totals, "finish_reasons": dict(self.finish_reasons), "error_statuses": dict(self.error_statuses),
                "records": {k: list(v) for k, v in self.cols.items()},
                "stage_sums": {"requests": self.stage_requests} | self.stage_sums, "direct_writes": dict(self.direct)}


def merge_snapshots(snaps: list[dict]) -> dict:
    """ArmRecords snapshots of one arm from several ingress replicas -> one (records concatenated)."""
    out: dict[str, Any] = dict.fromkeys(TOTAL_FIELDS, 0)
    out["finish_reasons"], out["error_statuses"] = {}, {}
    out["records"] = {f: [] for f in RECORD_FIELDS}
    out["direct_writes"] = dict.fromkeys(DIRECT_FIELDS, 0)
    sums: dict[str, float] = {}
    for s in snaps:
        for k, v in (s.get("direct_writes") or {}).items():
            out["direct_writes"][k] = out["direct_writes"].get(k, 0) + v
        for k in TOTAL_FIELDS:
            out[k] += s.get(k, 0)
        for key in ("finish_reasons", "error_statuses"):
            for r, n in s.get(key, {}).items():
                out[key][r] = out[key].get(r, 0) + n
        for f in RECORD_FIELDS:
            out["records"][f].extend(s.get("records", {}).get(f, []))
        for k, v in s.get("stage_sums", {}).items():
            sums[k] = sums.get(k, 0) + v
    n = sums.get("requests", 0)
    out["stages_ms"] = {"requests": n} | {k: round(sums[k] / n, 3) for k in STAGE_FIELDS if n and k in sums}
    return out | ratios(out)


#: replica counters summed over an arm's replicas
_SUMMED = ("slots", "active", "queued", "free_slots", "streams", "reserved_cells")


def aggregate_replicas(stats: list[dict]) -> dict:
    """The engine side of an arm: every live replica's /v1/stats dict, summed (exceptions are listed)."""
    ok = [s for s in stats if isinstance(s, dict)]
    out: dict[str, Any] = {"replicas": len(ok), "replica_ids": [s.get("replica_id") for s in ok],
                           "pids": [s.get("process", {}).get("pid") for s in ok]}
    if len(ok) < len(stats):
        out["errors"] = [f"{type(e).__name__}: {e}" for e in stats if not isinstance(e, dict)]
    for k in _SUMMED:
        out[k] = sum(s.get(k, 0) or 0 for s in ok)
    sched: dict[str, float] = {}
    for s in ok:
        for k, v in (s.get("scheduler") or {}).items():
            if isinstance(v, (int, float)):
                sched[k] = sched.get(k, 0) + v
    out["scheduler"] = sched
    drafts = tokens = accepted = 0
    per_pos: list[int] = []
    for s in ok:
        d, t, a, pp = spec_totals(s.get("speculators") or {})
        drafts, tokens, accepted = drafts + d, tokens + t, accepted + a
        per_pos.extend([0] * (len(pp) - len(per_pos)))
        for i, v in enumerate(pp):
            per_pos[i] += v
    spec = {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted, "accepted_per_pos": per_pos}
    out["speculators"] = spec | ratios(spec)
    if ok:
        out["mode"] = ok[0].get("mode")
        out["chain"] = ok[0].get("chain")
        out["chain_config"] = ok[0].get("chain_config")
    return out
