"""FeatureWindow (engine/feature_window.py): which target feature positions a DFlash draft's cache holds.

The worked examples follow a sequence through acceptance, rejection (a commit
restarting earlier), a context shift and a size bound; a random walk checks
that the KV edits the window returns, applied to a model cache (position ->
row id), always leave exactly the window's injected positions with the right
rows in them.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import feature_window
from specray.engine.feature_window import FeatureWindow, KvOp


def rows(pos0: int, n: int) -> np.ndarray:
    """Row j says which committed position it is the feature of."""
    return np.arange(pos0, pos0 + n, dtype=np.float32)[:, None]


def test_doctests():
    failed, attempted = doctest.testmod(feature_window)
    assert attempted >= 3 and failed == 0


def test_acceptance_appends_and_injection_takes_all_pending_rows():
    w = FeatureWindow()
    assert w.append(0, rows(0, 6)) == [] and (w.injected, w.end, w.pending) == (0, 6, 6)
    pos0, r = w.take_pending()
    assert pos0 == 0 and r[:, 0].tolist() == list(range(6)) and w.pending == 0
    # a round: last token + 3 accepted draft tokens, then a round with 1 + 0, both before the next draft
    w.append(6, rows(6, 4))
    w.append(10, rows(10, 1))
    pos0, r = w.take_pending()
    assert pos0 == 6 and r[:, 0].tolist() == [6, 7, 8, 9, 10] and (w.lo, w.injected, w.end) == (0, 11, 11)
    with pytest.raises(ValueError, match="ends at 11"):
        w.append(12, rows(12, 1))  # a gap: the window never guesses


def test_rejection_trims_the_cache_and_the_pending_rows():
    w = FeatureWindow()
    w.append(0, rows(0, 8))
    w.take_pending()  # 0..7 in the cache
    w.append(8, rows(8, 4))  # 8..11 pending
    # the target went back to position 6: cells 6, 7 leave, pending 8..11 are dropped
    assert w.trim(6) == [KvOp("rm", 6, 8)]
    assert (w.lo, w.injected, w.end, w.pending) == (0, 6, 6, 0)
    w.append(6, rows(6, 2))
    pos0, r = w.take_pending()
    assert pos0 == 6 and r[:, 0].tolist() == [6, 7]
    assert w.trim(8) == [] and w.trim(100) == []  # nothing past the end


def test_context_shift_moves_cells_and_pending_rows():
    w = FeatureWindow()
    w.append(0, rows(0, 20))
    w.take_pending()  # 0..19 in the cache
    w.append(20, rows(20, 5))  # 20..24 pending
    ops = w.shift(4, 10)  # keep 0..3, drop 4..13, 14..24 become 4..14
    assert ops == [KvOp("rm", 4, 14), KvOp("add", 14, 20, -10)]
    assert (w.lo, w.injected, w.end) == (0, 10, 15)
    pos0, r = w.take_pending()
    assert pos0 == 10 and r[:, 0].tolist() == [20, 21, 22, 23, 24]  # the rows keep what they are, not where
    assert w.shift(15, 4) == [] and w.shift(2, 0) == []  # nothing held after n_keep; nothing discarded


def test_shift_inside_the_pending_rows_only():
    w = FeatureWindow()
    w.append(0, rows(0, 4))
    w.take_pending()
    w.append(4, rows(4, 6))  # 4..9 pending
    assert w.shift(5, 3) == []  # the cache (0..3) is untouched
    pos0, r = w.take_pending()
    assert (pos0, w.end) == (4, 7) and r[:, 0].tolist() == [4, 8, 9]


def test_size_bound_keeps_the_last_positions():
    w = FeatureWindow(size=8)
    assert w.append(0, rows(0, 12)) == []  # nothing in the cache yet: the 4 oldest rows are just dropped
    assert (w.lo, w.injected, w.end) == (4, 4, 12)
    pos0, r = w.take_pending()
    assert pos0 == 4 and r[:, 0].tolist() == list(range(4, 12))
    assert w.append(12, rows(12, 3)) == [KvOp("rm", 4, 7)]  # 3 more: the 3 oldest cells leave
    assert (w.lo, w.injected, w.end, len(w)) == (7, 12, 15, 8)


def _apply(cache: dict[int, float], ops: list[KvOp]) -> dict[int, float]:
    for op in ops:
        if op.kind == "rm":
            cache = {p: v for p, v in cache.items() if not op.p0 <= p < op.p1}
        else:
            cache = {p + op.delta if op.p0 <= p < op.p1 else p: v for p, v in cache.items()}
    return cache


@pytest.mark.parametrize("size", [None, 16])
def test_random_walk_keeps_the_cache_equal_to_the_window(size):
    rng = np.random.default_rng(7)
    w = FeatureWindow(size=size)
    cache: dict[int, float] = {}  # position -> the row's id (its original position)
    truth: list[float] = []  # the target's committed sequence of row ids, by position
    next_id = 0.0
    for _ in range(400):
        op = rng.choice(["append", "append", "inject", "trim", "shift"])
        if op == "append":
            n = int(rng.integers(1, 6))
            r = np.arange(next_id, next_id + n, dtype=np.float32)[:, None]
            next_id += n
            cache = _apply(cache, w.append(len(truth), r))
            truth += r[:, 0].tolist()
        elif op == "inject":
            pos0, r = w.take_pending()
            for j in range(len(r)):
                assert pos0 + j not in cache
                cache[pos0 + j] = float(r[j, 0])
        elif op == "trim" and truth:
            pos = int(rng.integers(0, len(truth) + 1))
            cache = _apply(cache, w.trim(pos))
            truth = truth[:pos]
        elif op == "shift" and len(truth) > 4:
            keep, disc = int(rng.integers(0, len(truth) // 2)), int(rng.integers(1, len(truth) // 2 + 1))
            cache = _apply(cache, w.shift(keep, disc))
            truth = truth[:keep] + truth[keep + disc :]
        assert w.end == len(truth)
        assert sorted(cache) == list(range(w.lo, w.injected))
        assert all(cache[p] == truth[p] for p in cache)
        if size is not None:
            assert len(w) <= size
    pos0, r = w.take_pending()
    assert r[:, 0].tolist() == truth[pos0:] if len(r) else pos0 == len(truth)
