"""DecodeCostModel.observe keeps its table without walking all of it every round (the most seen size kept as the
counts grow, the monotone pass ending where it changes nothing): it must learn bitwise the table the whole-table
version learns, whatever the decodes observed."""

from __future__ import annotations

import numpy as np

from specray.engine.cost import DecodeCostModel


class WholeTable(DecodeCostModel):
    """The model as it was: the anchor found by a max over every size seen, the whole table passed each time."""

    def _count(self, n):
        self._seen[n] = self._seen.get(n, 0) + 1
        return max(self._seen, key=lambda k: (self._seen[k], -k))

    def _keep_monotone(self, changed=0):
        n0, s0 = self._ns[0], self._secs[0]
        for j in range(1, len(self._secs)):
            if self._secs[j] < self._secs[j - 1]:
                self._secs[j] = self._secs[j - 1]
            self._secs[j] = min(self._secs[j], s0 * self._ns[j] / n0)


def _decodes(seed: int, count: int):
    """Decodes as rounds make them: mostly one size, drafts of other sizes, sizes new to the table, below its
    smallest entry and past its largest, noisy times, long and short contexts, shape changes."""
    rng = np.random.default_rng(seed)
    steady = int(rng.integers(1, 5))
    for _ in range(count):
        u = rng.random()
        n = steady if u < 0.5 else int(rng.integers(1, 12)) if u < 0.9 else int(rng.integers(1, 200))
        seconds = 0.01 * (1 + 0.15 * n) * float(rng.lognormal(0.0, 0.3))
        if rng.random() < 0.05:
            seconds *= 5  # a stalled decode
        cells = None if rng.random() < 0.3 else float(rng.integers(0, 4000))
        since = None if rng.random() < 0.2 else int(rng.integers(0, 3))
        yield n, seconds, cells, since


def test_observe_learns_what_the_whole_table_pass_learns():
    tables = [None, {1: 0.010, 2: 0.0125, 4: 0.0175, 8: 0.0275, 16: 0.0475, 32: 0.0875},
              {2: 0.02, 3: 0.021, 5: 0.03}, {n: 0.01 + 0.0001 * n for n in range(1, 70)}]
    for seed in range(12):
        table = tables[seed % len(tables)]
        fast, whole = DecodeCostModel(dict(table) if table else None), WholeTable(dict(table) if table else None)
        for k, (n, seconds, cells, since) in enumerate(_decodes(seed, 1500)):
            fast.observe(n, seconds, cells, since)
            whole.observe(n, seconds, cells, since)
            if k % 50 == 0 or k == 1499:
                assert fast.table() == whole.table(), (seed, k)
        assert fast.speed == whole.speed and fast.attn_seconds == whole.attn_seconds
        # the table keeps its rule: more rows never cost less, nor more than as many smallest decodes
        ns, secs = list(fast.table()), list(fast.table().values())
        assert all(b >= a for a, b in zip(secs, secs[1:]))
        assert all(s <= secs[0] * n / ns[0] * (1 + 1e-12) for n, s in zip(ns, secs))
