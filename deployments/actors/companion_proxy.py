"""The router's stand-in for a model speculator that runs in the companion actor.

A `CompanionProxy` is the speculator the router's chain holds for `draft`,
`mtp` or `eagle3` in distributed mode. It buffers what the scheduler tells it
(sequences begun and ended, committed tokens, hidden-row records) and sends
all of it with the round's draft requests in ONE companion call; rounds that
ask it for nothing make no call. Subclasses decide what is buffered and which
companion method takes it (`_send`).

A sequence drafts only on the companion generation (`client.epoch`) it began
on: a replacement companion has no mirror of it. The chain prices a draft
before asking (`draft_seconds`, `catchup_seconds`) with the companion's
measured step costs and the hop it last saw.
"""

from __future__ import annotations

import time
from abc import abstractmethod

import numpy as np

from specray.engine.cost import DecodeCostModel
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE, DraftRequest
from specray.engine.speculators.draft_base import ModelSpeculator


class CompanionProxy(ModelSpeculator):
    """`client` is a CompanionClient (`call(method, payload, default=...)`, `epoch`)."""

    def __init__(self, params, client, cost_table: dict[int, float] | None = None) -> None:
        super().__init__()
        self.params = params
        self.max_steps = params.n_max
        self.client = client
        self.step_cost = DecodeCostModel(cost_table or None, ema=0.1)
        self.hop_seconds = 0.0  # EMA of a call's time outside the companion
        self.calls = 0  # every companion call, flushes included
        self.draft_calls = 0  # calls that asked for drafts: at most one per round
        self.failed_calls = 0
        self.unsynced = 0
        self._epoch: dict[int, int] = {}  # companion generation each sequence began on
        self._drafted_len: dict[int, int] = {}  # history length at each sequence's last draft request

    # ---- price ---------------------------------------------------------------------------------------
    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        n = max(1, n_seqs)
        return self.hop_seconds + self.step_cost.cost(2 * n) + max(0, n_steps - 1) * self.step_cost.cost(n)

    def catchup_seconds(self, seq_id: int, history: np.ndarray) -> float:
        rows = len(history) - self._drafted_len.get(seq_id, 0) + 1
        return max(0.0, self.step_cost.cost(rows) - self.step_cost.cost(2)) if rows > 2 else 0.0

    # ---- sequence life -------------------------------------------------------------------------------
    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self._drafted_len.pop(seq_id, None)
        self._epoch[seq_id] = self.client.epoch

    def _end(self, seq_id: int) -> None:
        self._epoch.pop(seq_id, None)
        self._drafted_len.pop(seq_id, None)

    def _current(self, seq_id: int) -> bool:
        """seq_id began on the companion that serves now (its mirror exists there)."""
        return self._epoch.get(seq_id) == self.client.epoch

    # ---- one call per round --------------------------------------------------------------------------
    @abstractmethod
    def _send(self, requests: list[tuple[int, int, int, int]]) -> dict | None:
        """Send the buffer with draft requests [(seq, last token, history length, n_max)]; the companion's
        answer ({"drafts", "unsynced", "inside_s", "step_costs"}), or None if the call failed."""

    def _answered(self, seq_id: int, draft: np.ndarray, res: dict, i: int) -> None:
        """The companion's answer `res` gave `draft` (what was kept of it) for seq_id, the round's i-th request:
        what else it says about that draft (runner-ups) is read here. Nothing by default."""

    def _call(self, method: str, payload: dict) -> dict | None:
        self.calls += 1
        res = self.client.call(method, payload, default=None)
        if res is None:  # down or failed: the companion is being replaced (new epoch)
            self.failed_calls += 1
        return res

    def _draft_one(self, req: DraftRequest) -> np.ndarray:  # pragma: no cover - draft() is batched
        return self.draft([req])[0]

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = [EMPTY_DRAFT] * len(requests)
        sent, idx = [], []
        for i, r in enumerate(requests):
            self.stats.calls += 1
            if r.n_max > 0 and len(r.history) and self._current(r.seq_id):
                sent.append((r.seq_id, int(r.history[-1]), len(r.history), int(r.n_max)))
                idx.append(i)
                self._drafted_len[r.seq_id] = len(r.history)
        if sent:
            self.draft_calls += 1
            res = self._send(sent)
            if res is not None:
                wall = time.perf_counter() - t0
                self.hop_seconds += 0.2 * (max(0.0, wall - res["inside_s"]) - self.hop_seconds)
                self.step_cost = DecodeCostModel({int(k): v for k, v in res["step_costs"].items()}, ema=0.1)
                self.unsynced += len(res["unsynced"])
                for j, (i, d) in enumerate(zip(idx, res["drafts"])):
                    # a copy (of the part kept): through a compiled graph the drafts are views of its channel's buffer
                    d = np.asarray(d, dtype=TOKEN_DTYPE)[: requests[i].n_max].copy()
                    if len(d):
                        self.stats.drafts_generated += 1
                        out[i] = d
                    self._answered(requests[i].seq_id, d, res, j)
        self.stats.time_draft_s += time.perf_counter() - t0
        return out

    def counters(self) -> dict:
        return {"calls": self.calls, "draft_calls": self.draft_calls, "failed_calls": self.failed_calls,
                "unsynced": self.unsynced, "hop_ms": 1000 * self.hop_seconds}


def answer_draft_requests(spec, requests) -> tuple[list[np.ndarray], list[int], bool]:
    """The companion's side of a round's draft requests [(seq, last token, history length, n_max)]: each
    sequence's history is what `spec` mirrored (`committed`) plus the last token; a request whose history
    length does not match gets no draft and its sequence is listed as unsynced. (drafts, unsynced, drafted:
    whether `spec` was asked at all)."""
    reqs, where, unsynced = [], [], []
    for i, (seq, last, n_hist, n_max) in enumerate(requests):
        committed = spec.committed(seq)
        if len(committed) != n_hist - 1:
            unsynced.append(seq)
            continue
        reqs.append(DraftRequest(seq, np.append(committed, np.int32(last)).astype(TOKEN_DTYPE), n_max))
        where.append(i)
    drafts = [EMPTY_DRAFT] * len(requests)
    if reqs:
        for i, d in zip(where, spec.draft(reqs)):
            drafts[i] = d
    return drafts, unsynced, bool(reqs)
