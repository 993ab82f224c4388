"""plan_draft_lengths sorts and takes running minima in Python floats: its lengths must be those of the numpy
formula it replaced (kept here as the reference), ties, padded buckets and fixed costs included."""

from __future__ import annotations

import numpy as np

from specray.engine.planner import plan_draft_lengths
from specray.engine.verify_shape import batch_rows


def _reference(prefix_probs, base_tokens, cost, n_decoding=None, extra_seconds=None, rows=None):
    """The numpy version (np.minimum.accumulate per candidate, a stable argsort), as it was."""
    n = len(prefix_probs)
    if n == 0:
        return []
    n_decoding = n if n_decoding is None else n_decoding
    owners, probs = [], []
    for s, p in enumerate(prefix_probs):
        p = np.minimum.accumulate(np.asarray(p, dtype=np.float64)) if len(p) else p
        owners.extend([s] * len(p))
        probs.extend(p.tolist() if len(p) else [])
    if not probs:
        return [0] * n
    order = np.argsort(-np.asarray(probs), kind="stable")
    taken = [0] * n
    base_cost = cost(base_tokens if rows is None else rows(taken))
    best_rate = n_decoding / base_cost if base_cost > 0 else 0.0
    best_k, gain, fixed, started = 0, float(n_decoding), 0.0, [False] * n
    for k, idx in enumerate(order, start=1):
        s = owners[idx]
        gain += probs[idx]
        if extra_seconds is not None and not started[s]:
            fixed += extra_seconds[s]
            started[s] = True
        taken[s] += 1
        rate = gain / (cost(base_tokens + k if rows is None else rows(taken)) + fixed)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_k = rate, k
    lengths = [0] * n
    for idx in order[:best_k]:
        lengths[owners[idx]] += 1
    if rows is not None and extra_seconds is None:
        sizes = [len(p) for p in prefix_probs]
        for s in range(n):
            while lengths[s] < sizes[s] and rows(lengths[:s] + [lengths[s] + 1] + lengths[s + 1:]) == rows(lengths):
                lengths[s] += 1
    return lengths


def test_lengths_equal_the_numpy_formula():
    rng = np.random.default_rng(5)
    h100 = lambda n: 0.0016 if n == 1 else 0.0025 if n <= 8 else 0.0025 + 0.0003 * (n - 8)
    cpu = lambda n: 0.010 + 0.003 * (n - 1)
    checked = sent = 0
    for _ in range(400):
        n = int(rng.integers(1, 9))
        # few distinct values (ties across candidates), some rising (the running minimum matters), some empty
        probs = [np.round(rng.uniform(0.0, 1.0, int(rng.integers(0, 9))), 1) for _ in range(n)]
        cost = h100 if rng.random() < 0.5 else cpu
        extra = [float(x) for x in rng.uniform(0, 0.002, n)] if rng.random() < 0.3 else None
        rows = (lambda lengths: batch_rows(lengths, (1, 4, 8))) if rng.random() < 0.3 else None
        base = n + int(rng.integers(0, 3))
        got = plan_draft_lengths(probs, base, cost, extra_seconds=extra, rows=rows)
        assert got == _reference(probs, base, cost, extra_seconds=extra, rows=rows), (probs, base, extra, rows)
        checked += 1
        sent += sum(got) > 0
    assert checked == 400 and 50 < sent < 400  # both outcomes were exercised
