"""What a target decode of n tokens costs, measured, not assumed.

On a CPU a verify batch of k tokens costs far more than one token (SmolLM2:
prompt processing is only ~2.4x faster per token than decoding), so the chain
must know the price of every draft token it sends. The model starts from a
calibration (decode batches of several sizes at start-up) and follows the
rounds it actually runs (an exponential average per batch size).

>>> m = DecodeCostModel({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024})
>>> round(m.cost(3), 4)   # linear between measured sizes
0.014
>>> round(m.cost(16), 4)  # beyond the table: extrapolate the last slope
0.04
"""

from __future__ import annotations

import bisect
import threading


class DecodeCostModel:
    def __init__(self, seconds_by_n: dict[int, float] | None = None, ema: float = 0.05) -> None:
        # a plausible CPU shape until calibrated: 10 ms + 2.5 ms per extra token
        table = seconds_by_n or {1: 0.010, 2: 0.0125, 4: 0.0175, 8: 0.0275, 16: 0.0475, 32: 0.0875}
        self._ns = sorted(table)
        self._secs = [float(table[n]) for n in self._ns]
        self._ema = ema
        self._lock = threading.Lock()

    def table(self) -> dict[int, float]:
        return dict(zip(self._ns, self._secs))

    def cost(self, n: int) -> float:
        """Seconds for one target decode holding n tokens (n >= 1)."""
        ns, secs = self._ns, self._secs
        if n <= ns[0]:
            return secs[0] * n / ns[0] if n > 0 else 0.0
        i = bisect.bisect_left(ns, n)
        if i < len(ns) and ns[i] == n:
            return secs[i]
        if i >= len(ns):  # extrapolate with the last segment's slope
            if len(ns) == 1:
                return secs[0] * n / ns[0]
            slope = (secs[-1] - secs[-2]) / (ns[-1] - ns[-2])
            return secs[-1] + slope * (n - ns[-1])
        n0, n1, s0, s1 = ns[i - 1], ns[i], secs[i - 1], secs[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    def observe(self, n: int, seconds: float) -> None:
        """Fold one measured decode into the table (nearest calibrated size)."""
        if n <= 0 or seconds <= 0:
            return
        with self._lock:
            i = bisect.bisect_left(self._ns, n)
            if i < len(self._ns) and self._ns[i] == n:
                self._secs[i] += self._ema * (seconds - self._secs[i])
            elif n > self._ns[-1] or len(self._ns) < 64:
                self._ns.insert(i, n)
                self._secs.insert(i, seconds)
            self._keep_monotone()

    def _keep_monotone(self) -> None:
        # a decode of more tokens never costs less; noise must not make it so
        for j in range(1, len(self._secs)):
            if self._secs[j] < self._secs[j - 1]:
                self._secs[j] = self._secs[j - 1]
