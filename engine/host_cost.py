"""What a round costs the host, beyond the target's decode: learnt from live rounds.

A round's host time (admission, drafting, verification, bookkeeping,
emission; round_stages.py) grows with the sequences decoding in it and with
the draft rows it verifies (each is verified, accepted or rolled back, and
mirrored into the speculators). On this CPU it is a few percent of a 10 ms
decode; on a GPU, where a decode of a small model takes 1-2 ms, it is a third
of the round or more, so the draft planner must price it: a draft row that
wins 0.3 tokens is worth sending for a 10 ms round and not for a 1.6 ms one
whose every extra row costs 0.1 ms of host work on top of the decode.

The model is host = a + b * decoding sequences + c * draft rows, fitted by
least squares over recent rounds (exponential forgetting, so it follows the
machine), with a weak prior that keeps it defined before rounds vary.

>>> m = HostCostModel()
>>> for i in range(400):   # 0.15 ms a round + 0.05 ms a sequence + 0.02 ms a draft row
...     seqs, rows = 1 + i % 4, (i * 7) % 9
...     m.observe(seqs, rows, 0.00015 + 0.00005 * seqs + 0.00002 * rows)
>>> [round(x * 1e6) for x in m.coefficients()]   # microseconds
[150, 50, 20]
>>> round(m.round_seconds(4, 8) * 1e3, 3)
0.51
"""

from __future__ import annotations

import threading

import numpy as np


class HostCostModel:
    def __init__(self, forget: float = 0.995, refit_every: int = 16) -> None:
        # forget: each round's weight decays by this factor per later round (0.995: ~200 rounds of memory)
        self._forget = forget
        self._refit_every = refit_every
        # weighted sums over rounds of x x^T (its 6 distinct entries: 11 1s 1r ss sr rr) and x y, x = (1,
        # sequences, draft rows), kept as Python floats: this runs every round, and numpy's per-call cost on
        # 3-vectors was most of it. The prior: a weak pull of the slopes to 0 (a host that never drafted has
        # no evidence that rows cost anything)
        self._xx = [1e-6, 0.0, 0.0, 1e-3, 0.0, 1e-3]
        self._xy = [0.0, 0.0, 0.0]
        self._coef = (0.0, 0.0, 0.0)
        self._n = 0
        self._lock = threading.Lock()

    def observe(self, n_sequences: int, n_draft_rows: int, seconds: float) -> None:
        """One round's host time (its wall time minus the target's decode)."""
        if seconds < 0 or n_sequences <= 0:
            return
        f, s, r = self._forget, float(n_sequences), float(n_draft_rows)
        with self._lock:
            xx, xy = self._xx, self._xy
            for i, v in enumerate((1.0, s, r, s * s, s * r, r * r)):
                xx[i] = f * xx[i] + v
            for i, v in enumerate((seconds, s * seconds, r * seconds)):
                xy[i] = f * xy[i] + v
            self._n += 1
            if self._n % self._refit_every == 0 or self._n <= self._refit_every:
                self._refit()

    def _refit(self) -> None:
        a, b, c, d, e, g = self._xx
        m = np.array([[a, b, c], [b, d + 1e-9, e], [c, e, g + 1e-9]])
        try:
            coef = np.linalg.solve(m, np.array(self._xy))
        except np.linalg.LinAlgError:
            return
        # a negative cost would make rows look like they save time
        self._coef = tuple(float(x) for x in np.maximum(coef, 0.0))

    def coefficients(self) -> tuple[float, float, float]:
        """(seconds per round, per decoding sequence, per draft row)."""
        return self._coef

    def round_seconds(self, n_sequences: int, n_draft_rows: int) -> float:
        a, b, c = self.coefficients()
        return a + b * n_sequences + c * n_draft_rows

    @property
    def rounds(self) -> int:
        return self._n

    def to_dict(self) -> dict:
        a, b, c = self.coefficients()
        return {"ms_per_round": a * 1e3, "ms_per_sequence": b * 1e3, "ms_per_draft_row": c * 1e3,
                "rounds_seen": self._n}
