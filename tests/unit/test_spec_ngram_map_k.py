"""ngram_map_k: n-gram -> first position index, per-key adaptive draft length."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculators.ngram_map_k import (
    NgramKeyIndex,
    NgramMapKParams,
    NgramMapKSpeculator,
    ngram_map_k_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle


def spec(n=2, m=3, min_hits=1):
    return NgramMapKSpeculator(NgramMapKParams(size_n=n, size_m=m, min_hits=min_hits))


def reference(history, n, m, min_hits=1):
    """First occurrence j of the last n tokens with j + n + m <= len(history) - 1."""
    h = [int(t) for t in history]
    L = len(h)
    if L <= n:
        return []
    key = h[L - n :]
    hits = [j for j in range(0, L - n - m) if h[j : j + n] == key]
    if len(hits) < min_hits or not hits:
        return []
    j = hits[0]
    return h[j + n : j + n + m]


def test_index_and_first_occurrence():
    ix = NgramKeyIndex(2, 2)
    h = arr(1, 2, 3, 4, 1, 2, 5, 6, 1, 2)
    ix.sync(h)
    assert ix.n_indexed == 6  # j + 2 + 2 <= 9
    assert ix.find(arr(1, 2)) == 0 and ix.count(arr(1, 2)) == 2
    # the first occurrence is drafted, not the most recent one (-> 5 6)
    d, key = ngram_map_k_draft(ix, h)
    assert d.tolist() == [3, 4] and key == arr(1, 2).tobytes()


def test_empty_short_and_unindexed():
    sp = spec()
    assert len(draft1(sp, 0, arr(4))) == 0
    assert len(draft1(sp, 1, arr(1, 2))) == 0
    # [1 2] occurs earlier but only 2 tokens follow it inside history[:-1] (< m=3): not indexed yet
    assert len(draft1(sp, 2, arr(1, 2, 8, 1, 2))) == 0
    # one token more and it is (the draft may run into the current key)
    assert draft1(sp, 3, arr(1, 2, 8, 9, 1, 2)).tolist() == [8, 9, 1]


def test_overlapping_periodic_history():
    h = arr(*([1, 2] * 6))  # 1 2 1 2 ... 1 2
    sp = spec(n=2, m=3)
    assert draft1(sp, 0, h).tolist() == [1, 2, 1] == reference(h, 2, 3)


def test_adaptive_length_per_key_and_loser_verdicts_ignored():
    sp = spec(n=2, m=4)
    h = arr(1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 6, 0, 1, 2)
    assert draft1(sp, 0, h).tolist() == [3, 4, 5, 6]
    sp.accept(0, 4, 2, winner=True)  # target kept 2 -> this key now drafts 2
    h = np.concatenate([h, arr(3, 4, 9, 1, 2)])
    assert draft1(sp, 0, h).tolist() == [3, 4]
    sp.accept(0, 2, 0, winner=False)  # someone else's draft: no effect
    assert draft1(sp, 0, h).tolist() == [3, 4]
    # another key still drafts the full m
    h2 = np.concatenate([h, arr(5, 6)])
    assert draft1(sp, 0, h2).tolist() == [7, 8, 9, 5]
    # accepted 0 silences the key (llama.cpp n_accepted = 0)
    sp.accept(0, 4, 0, winner=True)
    assert len(draft1(sp, 0, np.concatenate([h2, arr(1, 5, 6)]))) == 0


def test_min_hits():
    h = arr(1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 9, 1, 2)
    assert len(draft1(spec(min_hits=3), 0, h)) == 0
    assert draft1(spec(min_hits=2), 0, h).tolist() == [3, 4, 5]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_reference(seed):
    rng = np.random.default_rng(seed)
    sp = spec(n=2, m=3)
    h = rng.integers(0, 4, 3).astype(np.int32)
    sp.begin(0, h[:2])
    for _ in range(60):
        h = np.concatenate([h, rng.integers(0, 4, int(rng.integers(1, 4))).astype(np.int32)])
        got = draft1(sp, 0, h).tolist()
        assert got == reference(h, 2, 3)
        if got:
            sp.accept(0, len(got), len(got), winner=True)  # full accept keeps length m


def test_rebuild_on_shorter_history_or_reused_seq_id():
    sp = spec()
    a = arr(1, 2, 3, 4, 5, 6, 1, 2)
    b = arr(9, 8, 7, 6, 5, 9, 8, 7, 9, 8)
    assert draft1(sp, 0, a).tolist() == [3, 4, 5]
    assert draft1(sp, 0, b).tolist() == [7, 6, 5]  # different tokens, same seq id
    assert draft1(sp, 0, b[:5]).tolist() == []  # shorter
    assert draft1(sp, 0, a).tolist() == [3, 4, 5]


def test_per_sequence_isolation():
    sp = spec()
    sp.begin(0, arr(1, 2, 3, 4, 5, 6))
    sp.begin(1, arr(7, 7, 7))
    assert draft1(sp, 0, arr(1, 2, 3, 4, 5, 6, 1, 2)).tolist() == [3, 4, 5]
    assert len(draft1(sp, 1, arr(7, 7, 7, 1, 2))) == 0  # seq 0's [1 2] is not visible
    sp.end(0)
    assert 0 not in sp._seqs and 1 in sp._seqs


def test_lifecycle_and_stats():
    rng = np.random.default_rng(2)
    block = rng.integers(100, 200, 40).tolist()
    prompt = rng.integers(0, 50, 20).tolist() + block + [7]
    sp = NgramMapKSpeculator(NgramMapKParams(size_n=3, size_m=8))
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=8)
    assert mine["tok_acc"] > 20
    check_stats(sp, mine)
    assert sp._seqs == {}
