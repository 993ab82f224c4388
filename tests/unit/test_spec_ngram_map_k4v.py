"""ngram_map_k4v: up to 4 continuations per key, draft only a dominant one."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculators.ngram_map_k4v import (
    MAX_VALUES,
    NgramMapK4vParams,
    NgramMapK4vSpeculator,
    NgramValueIndex,
    ngram_map_k4v_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle


def spec(n=1, m=2, min_hits=1):
    return NgramMapK4vSpeculator(NgramMapK4vParams(size_n=n, size_m=m, min_hits=min_hits))


def value_counts(ix, key):
    return {tuple(np.frombuffer(v[0], np.int32).tolist()): v[2] for v in ix.values.get(arr(*key).tobytes(), [])}


def test_value_statistics():
    ix = NgramValueIndex(1, 2)
    ix.sync(arr(7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 0, 7))
    assert value_counts(ix, [7]) == {(1, 2): 2, (3, 4): 1}
    assert value_counts(ix, [1]) == {(2, 7): 2}


def test_dominance_rule():
    # 1 x [1 2] vs 1 x [3 4]: 1 < 2 * 1 -> no draft
    assert len(draft1(spec(), 0, arr(7, 1, 2, 7, 3, 4, 0, 0, 7))) == 0
    # 2 x [1 2] vs 1 x [3 4]: 2 >= 2 * 1 -> the dominant value
    assert draft1(spec(), 0, arr(7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 0, 7)).tolist() == [1, 2]
    # 2 x [3 4] after 1 x [1 2]: the winner's tokens, not those after the first occurrence
    assert draft1(spec(), 0, arr(7, 1, 2, 7, 3, 4, 7, 3, 4, 0, 0, 7)).tolist() == [3, 4]
    # 2 vs 2: no draft
    assert len(draft1(spec(), 0, arr(7, 1, 2, 7, 3, 4, 7, 1, 2, 7, 3, 4, 0, 0, 7))) == 0


def test_at_most_four_values():
    h = arr(7, 1, 1, 7, 2, 2, 7, 3, 3, 7, 4, 4, 7, 5, 5, 7, 5, 5, 7, 5, 5, 0, 0, 7)
    ix = NgramValueIndex(1, 2)
    ix.sync(h)
    assert len(ix.values[arr(7).tobytes()]) == MAX_VALUES
    assert (5, 5) not in value_counts(ix, [7])  # the fifth distinct value is ignored
    assert len(ngram_map_k4v_draft(ix, h)[0]) == 0  # 1+1+1+1: nothing dominates


def test_min_hits_on_the_winning_value():
    h = arr(7, 1, 2, 9, 9, 9, 7)
    assert draft1(spec(min_hits=1), 0, h).tolist() == [1, 2]
    assert len(draft1(spec(min_hits=2), 0, h)) == 0
    h2 = arr(7, 1, 2, 7, 1, 2, 9, 9, 7)
    assert draft1(spec(min_hits=2), 0, h2).tolist() == [1, 2]


def test_empty_short_and_periodic():
    assert len(draft1(spec(), 0, arr())) == 0
    assert len(draft1(spec(), 0, arr(7))) == 0
    assert len(draft1(spec(n=3), 0, arr(1, 2, 3))) == 0
    # 1 2 1 2 ...: every occurrence of [1 2] is followed by [1 2 1]
    h = arr(*([1, 2] * 8))
    assert draft1(spec(n=2, m=3), 0, h).tolist() == [1, 2, 1]


def test_adaptive_length_per_value():
    sp = spec(n=1, m=3)
    h = arr(7, 1, 2, 3, 7, 1, 2, 3, 5, 5, 7)
    assert draft1(sp, 0, h).tolist() == [1, 2, 3]
    sp.accept(0, 3, 1, winner=True)
    h = np.concatenate([h, arr(1, 9, 9, 9, 7)])
    assert draft1(sp, 0, h).tolist() == [1]
    sp.accept(0, 1, 1, winner=False)  # loser verdicts are ignored
    assert draft1(sp, 0, h).tolist() == [1]


@pytest.mark.parametrize("seed", range(3))
def test_incremental_equals_fresh(seed):
    rng = np.random.default_rng(seed)
    inc = spec(n=2, m=2)
    h = rng.integers(0, 3, 2).astype(np.int32)
    for _ in range(50):
        h = np.concatenate([h, rng.integers(0, 3, int(rng.integers(1, 3))).astype(np.int32)])
        fresh = ngram_map_k4v_draft(NgramValueIndex(2, 2), h)[0].tolist()
        assert draft1(inc, 0, h).tolist() == fresh


def test_isolation_and_rebuild():
    sp = spec()
    sp.begin(0, arr(7, 1, 2, 9, 9))
    sp.begin(1, arr(8, 8, 8))
    assert draft1(sp, 0, arr(7, 1, 2, 9, 9, 7)).tolist() == [1, 2]
    assert len(draft1(sp, 1, arr(8, 8, 8, 7))) == 0
    # seq 0 reused for another sequence
    assert draft1(sp, 0, arr(7, 4, 4, 9, 9, 7)).tolist() == [4, 4]
    sp.end(1)
    assert set(sp._seqs) == {0}


def test_lifecycle_and_stats():
    rng = np.random.default_rng(3)
    block = rng.integers(100, 200, 40).tolist()
    prompt = rng.integers(0, 50, 20).tolist() + block + [7]
    sp = NgramMapK4vSpeculator(NgramMapK4vParams(size_n=3, size_m=6))
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=6)
    assert mine["tok_acc"] > 20
    check_stats(sp, mine)
