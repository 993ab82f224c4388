"""ngram_mod: shared rolling-hash pool (llama.cpp common_ngram_mod)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculators.ngram_mod import (
    ADD_CHUNK,
    EMPTY,
    LOW_ACCEPT_STREAK,
    NgramModParams,
    NgramModPool,
    NgramModSpeculator,
    ngram_mod_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle

C = 6364136223846793005


def llama_idx(window, size):
    """common_ngram_mod::idx: res = res * C + token (size_t arithmetic), then % size."""
    res = 0
    for t in window:
        res = (res * C + int(t)) % (1 << 64)
    return res % size


def spec(n_match=3, n_min=2, n_max=8, pool_size=1 << 16):
    return NgramModSpeculator(NgramModParams(n_match=n_match, n_min=n_min, n_max=n_max, pool_size=pool_size))


def test_hash_slots_match_llama_cpp():
    pool = NgramModPool(n=4, size=1_000_003)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 260_000, 50).astype(np.int32)
    pool.add_range(toks, 0, 46)
    for i in range(46):
        assert pool.hash(toks[i : i + 4]) % pool.size == llama_idx(toks[i : i + 4], pool.size)
    # the vectorised add put every next token at llama.cpp's slot (later adds win)
    expect = {}
    for i in range(46):
        expect[llama_idx(toks[i : i + 4], pool.size)] = int(toks[i + 4])
    for slot, tok in expect.items():
        assert pool.entries[slot] == tok
    assert pool.used == len(expect)
    # rolling the hash equals hashing the shifted window
    h = pool.hash(toks[0:4])
    for i in range(1, 40):
        h = pool.push(h, int(toks[i - 1]), int(toks[i + 3]))
        assert h == pool.hash(toks[i : i + 4])


def test_draft_n_min_n_max_and_misses():
    pool = NgramModPool(n=2, size=4093)
    h = arr(5, 1, 2, 3, 4, 6, 1, 2)
    pool.add_range(h[:-1], 0, len(h) - 1)
    assert ngram_mod_draft(pool, h, n_max=3, n_min=2).tolist() == [3, 4, 6]  # truncated at n_max
    assert ngram_mod_draft(pool, h, n_max=8, n_min=2).tolist() == [3, 4, 6, 1]  # miss after 4
    assert len(ngram_mod_draft(pool, h, n_max=8, n_min=5)) == 0  # miss before n_min
    assert len(ngram_mod_draft(pool, arr(7, 7, 7), n_max=8, n_min=0)) == 0  # first lookup misses
    assert len(ngram_mod_draft(NgramModPool(2, 11), h, 4, 1)) == 0  # never allocated


def test_periodic_history_drafts_the_loop():
    pool = NgramModPool(n=2, size=4093)
    h = arr(*([1, 2, 3] * 4))
    pool.add_range(h[:-1], 0, len(h) - 1)
    assert ngram_mod_draft(pool, h, n_max=7, n_min=7).tolist() == [1, 2, 3, 1, 2, 3, 1]


def test_short_histories_and_prompts():
    sp = spec(n_match=4)
    sp.begin(0, arr(1, 2))  # shorter than n_match: nothing added, no crash
    assert sp.pool.used == 0
    assert len(draft1(sp, 0, arr(1, 2, 3))) == 0
    assert len(draft1(sp, 0, arr(1, 2, 3, 4))) == 0
    assert len(draft1(sp, 9, arr(5))) == 0  # no begin, 1 token


def test_prompt_ngrams_are_added_at_begin_and_new_ones_in_chunks():
    sp = spec(n_match=2, n_min=1, n_max=4)
    prompt = arr(10, 11, 12, 13, 14)
    sp.begin(0, prompt)  # adds n-grams 0..2; i_last = 3
    h = np.concatenate([prompt, arr(10, 11)])
    assert draft1(sp, 0, h).tolist() == [12, 13, 14]
    # generated [50 51] -> 52 is added only once history[:-1] is > i_last + ADD_CHUNK long
    h = np.concatenate([h, arr(50, 51, 52, *range(60, 60 + 24), 50, 51)])
    assert len(h) - 1 == 3 + ADD_CHUNK  # exactly at the threshold: not yet
    assert len(draft1(sp, 0, h)) == 0
    h = np.concatenate([h, arr(98, 51, 52)])  # key [51 52]: seen once, followed by 60
    assert draft1(sp, 0, h).tolist() == [60, 61, 62, 63]
    assert sp._seqs[0].i_last == len(h) - 1 - 2


def test_incremental_hashing_equals_fresh_drafts():
    rng = np.random.default_rng(5)
    sp = spec(n_match=3, n_min=1, n_max=6)
    h = rng.integers(0, 5, 10).astype(np.int32)
    sp.begin(0, h)
    for _ in range(80):
        h = np.concatenate([h, rng.integers(0, 5, int(rng.integers(1, 4))).astype(np.int32)])
        got = draft1(sp, 0, h, n_max=6)
        assert got.tolist() == ngram_mod_draft(sp.pool, h, 6, 1).tolist()
    # after many calls everything older than the last chunk is in the pool
    info = sp._seqs[0]
    assert info.i_last >= len(h) - 1 - 3 - ADD_CHUNK


def test_request_n_max_below_n_min_still_drafts():
    sp = spec(n_match=2, n_min=48, n_max=64)
    body = list(range(100, 140))
    sp.begin(0, arr(*body, 1, 2, 3))
    d = draft1(sp, 0, arr(*body, 1, 2, 3, 100, 101), n_max=16)
    assert d.tolist() == list(range(102, 118))
    # with the request allowing 64 the miss after 41 tokens (< n_min 48) voids the draft
    assert len(draft1(sp, 0, arr(*body, 1, 2, 3, 100, 101), n_max=64)) == 0


def test_reset_after_low_acceptance_streak():
    sp = spec(n_match=2, n_min=1, n_max=4)
    sp.begin(0, arr(1, 2, 3, 4, 5, 6))
    h = arr(1, 2, 3, 4, 5, 6, 1, 2)
    for i in range(LOW_ACCEPT_STREAK - 1):
        assert len(draft1(sp, 0, h)) == 4
        sp.accept(0, 4, 0, winner=True)
    sp.accept(0, 4, 0, winner=False)  # not ours: does not count
    sp.accept(0, 4, 4, winner=True)  # a good round breaks the streak
    for i in range(LOW_ACCEPT_STREAK - 1):
        sp.accept(0, 4, 0, winner=True)
    assert sp.n_resets == 0 and len(draft1(sp, 0, h)) == 4
    sp.accept(0, 4, 0, winner=True)  # 5th low round in a row
    assert sp.n_resets == 1
    assert (sp.pool.entries == EMPTY).all() and sp.pool.used == 0
    assert sp._seqs[0].i_last == 0
    assert len(draft1(sp, 0, h)) == 0  # emptied; re-added only once a chunk is due


def test_occupancy_reset_at_begin():
    sp = spec(n_match=2, pool_size=64)
    sp.begin(0, arr(*range(100, 140)))  # ~38 n-grams in 64 slots: > 25 % used
    assert sp.n_resets == 1 and sp.pool.used == 0
    sp2 = spec(n_match=2, pool_size=1 << 16)
    sp2.begin(0, arr(*range(100, 140)))
    assert sp2.n_resets == 0 and sp2.pool.used > 30


def test_pool_is_shared_across_sequences():
    sp = spec(n_match=2, n_min=1, n_max=3)
    sp.begin(0, arr(1, 2, 3, 4, 5))
    sp.begin(1, arr(9, 9))
    assert draft1(sp, 1, arr(9, 9, 7, 1, 2)).tolist() == [3, 4, 5]  # seq 0's prompt, by design
    sp.end(0)
    assert 0 not in sp._seqs and 1 in sp._seqs
    assert draft1(sp, 1, arr(9, 9, 7, 1, 2)).tolist() == [3, 4, 5]  # pool survives end


def test_state_roundtrip():
    sp = spec(n_match=2, n_min=1, n_max=3)
    assert sp.get_state()["entries"] is None  # an empty pool is not copied
    sp.begin(0, arr(1, 2, 3, 4, 5))
    state = sp.get_state()
    sp2 = spec(n_match=2, n_min=1, n_max=3)
    sp2.set_state(state)
    assert draft1(sp2, 0, arr(8, 1, 2)).tolist() == [3, 4, 5]
    sp2.set_state(spec(n_match=2, n_min=1, n_max=3).get_state())  # an empty pool's state empties this one
    assert sp2.pool.used == 0 and len(draft1(sp2, 0, arr(8, 1, 2))) == 0


def test_params_defaults_and_bounds():
    p = NgramModParams()
    assert (p.n_match, p.n_min, p.n_max, p.pool_size) == (24, 48, 64, 4 * 1024 * 1024)
    with pytest.raises(ValueError):
        NgramModParams(n_match=0)
    with pytest.raises(ValueError):
        NgramModParams(pool_size=0)


def test_lifecycle_and_stats():
    rng = np.random.default_rng(4)
    block = rng.integers(100, 200, 60).tolist()
    prompt = rng.integers(0, 50, 20).tolist() + block + [7]
    sp = spec(n_match=4, n_min=2, n_max=8)
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=8)
    assert mine["tok_acc"] > 30
    check_stats(sp, mine)


def test_pool_is_allocated_with_the_speculator_not_in_a_round():
    # a fresh 16 MiB pool costs tens of ms of page faults; the first admission round must not pay them
    sp = spec(pool_size=1 << 16)
    assert sp.pool.entries is not None and len(sp.pool.entries) == 1 << 16
    assert (sp.pool.entries == -1).all() and sp.pool.used == 0
