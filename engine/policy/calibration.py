"""Keeping a speculator's acceptance estimates honest: predicted vs realised, by draft position.

The acceptance tracker (acceptance.py) is right on average but overconfident
exactly where it costs most: a sequence that just copied a span gets a long
draft priced as if the copy goes on, and when it does not, one bet of 40
verify rows yields 4 tokens: a few such rounds can lose more time than every
other draft wins.

So every sent draft is scored after its verdict: at each position j the
tracker predicted P(tokens 0..j all accepted) = p_j, and the verdict says
whether they were (j < n_accepted). Summed by position bucket (0, 1, 2-3,
4-7, ...), realised / predicted is a factor that scales later estimates at
those positions. Learning is in tokens, so one big miss teaches at once, and
a speculator that keeps its long promises (ngram_mod copying a document)
keeps a factor near 1. The raw estimates are what is scored, so the factor
measures the tracker's bias, not its own. Raising an estimate takes more
evidence than lowering it (16 pseudo-tokens against 4): an over-promise costs
a batch of rejected rows, an under-promise only a draft not sent, and a
bucket raised by one lucky long copy is paid for by the next long bets.

>>> c = PrefixCalibration(prior_tokens=4.0)
>>> raw = 0.97 ** np.arange(1, 41)   # a 40-token draft promising 22.8 accepted tokens
>>> c.update(raw, n_accepted=4)        # it delivered 4
>>> [round(float(x), 2) for x in c.apply(raw)[[0, 3, 8, 39]]], round(float(c.apply(raw).sum()), 1)
([0.97, 0.9, 0.32, 0.13], 11.5)
>>> c = PrefixCalibration()
>>> for _ in range(50):
...     c.update(np.full(8, 0.5), n_accepted=8)   # underconfident: every token accepted
>>> [round(float(x), 2) for x in c.apply(np.full(8, 0.5))[[0, 7]]]
[0.8, 0.8]
>>> c = PrefixCalibration()
>>> c.update(np.full(8, 0.5), n_accepted=8)   # one draft's luck barely raises the estimate...
>>> round(float(c.apply(np.full(8, 0.5))[0]), 2)
0.52
>>> c = PrefixCalibration()
>>> c.update(np.full(8, 0.5), n_accepted=0)   # ...while one miss lowers it at once
>>> round(float(c.apply(np.full(8, 0.5))[0]), 2)
0.44
"""

from __future__ import annotations

import math

import numpy as np

from .acceptance import N_POS_BUCKETS, bucket_counts, pos_bucket_list, pos_buckets

#: a factor stays within these bounds: estimates are shrunk or raised, never zeroed or set free
FACTOR_MIN, FACTOR_MAX = 0.05, 2.0
#: predicted tokens a bucket remembers: old verdicts fade, so the factor follows the traffic
BUCKET_CAP = 2048.0
P_MAX = 0.999


class PrefixCalibration:
    def __init__(self, prior_tokens: float = 4.0, raise_prior_tokens: float = 16.0) -> None:
        self.prior_tokens = prior_tokens  # pseudo-tokens at factor 1 in every bucket
        self.raise_prior_tokens = raise_prior_tokens  # the same, where realised > predicted
        self.predicted = np.zeros(N_POS_BUCKETS)
        self.realised = np.zeros(N_POS_BUCKETS)
        self._factors: np.ndarray | None = None  # cached until the next update: every draft is calibrated
        self._factor_list: list[float] | None = None  # the same as floats (apply)

    def factors(self) -> np.ndarray:
        if self._factors is None:
            self._factors = np.array(self.factor_list())
        return self._factors

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """Calibrated prefix probabilities (non-increasing, below 1) for raw ones."""
        n = len(raw)
        if n == 0:
            return raw
        # numpy's steps (scale by the position's bucket factor, cap, running minimum) in Python floats: 1-8
        # positions, every draft scored, every round (the values are bitwise the same)
        f = self.factor_list()
        out = [0.0] * n
        low = math.inf
        for j, (r, b) in enumerate(zip(np.asarray(raw, dtype=np.float64).tolist(), pos_bucket_list(n))):
            low = min(low, min(r * f[b], P_MAX))
            out[j] = low
        return np.array(out)

    def factor_list(self) -> list[float]:
        """Each bucket's factor, (realised + k) / (predicted + k) within [FACTOR_MIN, FACTOR_MAX], k the prior
        (the raising one where realised > predicted), as Python floats; cached until the next update. Python,
        not numpy's where and clip: it is recomputed after every sent draft's verdict, where numpy's per-call
        overhead outweighs the arithmetic (the values are bitwise the same: tests/unit/test_acceptance_fast.py)."""
        if self._factor_list is None:
            hi, lo = self.raise_prior_tokens, self.prior_tokens
            self._factor_list = [min(max((r + (hi if r > p else lo)) / (p + (hi if r > p else lo)), FACTOR_MIN),
                                     FACTOR_MAX)
                                 for p, r in zip(self.predicted.tolist(), self.realised.tolist())]
        return self._factor_list

    def update(self, raw: np.ndarray, n_accepted: int) -> None:
        """A sent draft's verdict: raw[j] was the tracker's P(0..j accepted) for its j-th token."""
        n = len(raw)
        if n == 0:
            return
        self._factors = self._factor_list = None
        self.predicted += np.bincount(pos_buckets(n), weights=np.asarray(raw, dtype=np.float64),
                                      minlength=N_POS_BUCKETS)
        self.realised += bucket_counts(max(0, min(n_accepted, n)))
        over = self.predicted > BUCKET_CAP
        if over.any():
            scale = np.where(over, BUCKET_CAP / np.maximum(self.predicted, 1e-9), 1.0)
            self.predicted *= scale
            self.realised *= scale
