"""What a round costs the host, beyond the target's decode: learnt from live rounds.

A round's host time (admission, drafting, verification, bookkeeping,
emission; round_stages.py) grows with the sequences decoding in it, with the
draft rows it verifies (each is read, accepted or rolled back) and with the
tokens it emits (each is mirrored into the speculators, detokenised,
streamed). On a CPU it is a small share of a decode; on a GPU, where a
decode of a small model is short, it can be a large share of the round, so
the draft planner must price it: e.g. a draft row that wins 0.3 tokens can be
worth sending for a 10 ms round and not for a 1.6 ms one whose every extra row
costs 0.1 ms of host work on top of the decode.

The model is host = a + b * decoding sequences + c * draft rows + d * emitted
tokens, fitted by least squares over recent rounds (exponential forgetting, so
it follows the machine), with a weak prior that keeps it defined before rounds
vary. The planner prices a, b and c (`round_seconds`). It leaves d out: a
token's own work is paid once per token however it was produced, and counted
with the draft rows it would have made drafts look dearer than they are (more
rows, more tokens a round, the same work per token).

>>> m = HostCostModel()
>>> for i in range(600):   # 0.15 ms a round, 0.05 a sequence, 0.02 a draft row, 0.03 an emitted token
...     seqs, rows = 1 + i % 4, (i * 7) % 9
...     tokens = seqs + rows // (1 + i % 3)
...     m.observe(seqs, rows, 0.00015 + 0.00005 * seqs + 0.00002 * rows + 0.00003 * tokens, tokens)
>>> [round(x * 1e6) for x in m.coefficients()]   # microseconds
[150, 50, 20, 30]
>>> round(m.round_seconds(4, 8) * 1e3, 3)   # what the planner prices: without the tokens' own work
0.51
>>> fixed = HostCostModel(learn=False)
>>> fixed.observe(4, 8, 0.001); fixed.round_seconds(4, 8)   # learns nothing: prices no host work
0.0
"""

from __future__ import annotations

import threading

import numpy as np

#: the prior's weight on each slope (the intercept has none): a host that never drafted has no evidence that rows
#: cost anything
_PRIOR = (1e-6, 1e-3, 1e-3, 1e-3)


class HostCostModel:
    def __init__(self, forget: float = 0.995, refit_every: int = 16, learn: bool = True) -> None:
        # forget: each round's weight decays by this factor per later round (0.995: ~200 rounds of memory).
        # learn=False: observe() ignores rounds and the model prices no host work at all, as DecodeCostModel's
        # learn=False keeps its table: a replay or a test that prices rounds by a given decode table alone,
        # not by this machine's wall clock (which moves with whatever else runs on it)
        self.learn = learn
        self._forget = forget
        self._refit_every = refit_every
        # weighted sums over rounds of x x^T and x y, x = (1, sequences, draft rows, emitted tokens), kept as
        # Python floats: this runs every round, and numpy's per-call cost on 4-vectors was most of it
        self._xx = [[_PRIOR[i] if i == j else 0.0 for j in range(4)] for i in range(4)]
        self._xy = [0.0] * 4
        self._coef = (0.0, 0.0, 0.0, 0.0)
        self._n = 0
        self._lock = threading.Lock()

    def observe(self, n_sequences: int, n_draft_rows: int, seconds: float, n_emitted: int | None = None) -> None:
        """One round's host time (its wall time minus the target's decode); n_emitted: the tokens it emitted
        (default: one per sequence)."""
        if not self.learn or seconds < 0 or n_sequences <= 0:
            return
        f = self._forget
        x = (1.0, float(n_sequences), float(n_draft_rows), float(n_sequences if n_emitted is None else n_emitted))
        with self._lock:  # a comprehension per row: the same products and sums as an element-wise loop
            self._xx = [[f * r + xi * xj for r, xj in zip(row, x)] for row, xi in zip(self._xx, x)]
            self._xy = [f * y + xi * seconds for y, xi in zip(self._xy, x)]
            self._n += 1
            if self._n % self._refit_every == 0 or self._n <= self._refit_every:
                self._refit()

    def _refit(self) -> None:
        try:
            coef = np.linalg.solve(np.array(self._xx) + np.diag([0.0, 1e-9, 1e-9, 1e-9]), np.array(self._xy))
        except np.linalg.LinAlgError:
            return
        # a negative cost would make rows look like they save time
        self._coef = tuple(float(x) for x in np.maximum(coef, 0.0))

    def coefficients(self) -> tuple[float, float, float, float]:
        """(seconds per round, per decoding sequence, per draft row, per emitted token)."""
        return self._coef

    def round_seconds(self, n_sequences: int, n_draft_rows: int) -> float:
        """What the planner prices: the round's, its sequences' and its draft rows' host work."""
        a, b, c, _ = self._coef
        return a + b * n_sequences + c * n_draft_rows

    @property
    def rounds(self) -> int:
        return self._n

    def to_dict(self) -> dict:
        a, b, c, d = self._coef
        return {"ms_per_round": a * 1e3, "ms_per_sequence": b * 1e3, "ms_per_draft_row": c * 1e3,
                "ms_per_emitted_token": d * 1e3, "rounds_seen": self._n}
