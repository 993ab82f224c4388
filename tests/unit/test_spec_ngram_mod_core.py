"""NgramModPool.add_range's and .roll's compiled core (engine/speculators/_ngram_mod_core.c) against their
references, add_range_reference (numpy) and roll_reference: pools added to alike hold the same entries and count the
same slots used, the same pool rolls the same drafts, and the speculator drafts the same tokens with either."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculator import DraftRequest
from specray.engine.speculators import ngram_mod
from specray.engine.speculators.ngram_mod import HASH_MUL, MASK64, NgramModParams, NgramModPool, NgramModSpeculator


def test_the_core_is_built():
    """setup (pip install) builds it: a tree where it is missing would hash every prompt window in numpy."""
    assert ngram_mod.COMPILED_CORE, "not built: docs/troubleshooting.md, 'The compiled cores were not built'"


@pytest.mark.parametrize("seed", range(12))
def test_the_core_writes_the_pool_the_reference_writes(seed):
    """Window sizes 1-24, pools of 1 slot to a few thousand (collisions everywhere in the small ones, so the last
    write of a slot must win), vocabularies of 2 tokens to a real one's ids, ranges that start anywhere, stop
    before, at or past the end and are empty: after every add the two pools are equal, as are their counts."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 3, 24]))
    size = int(rng.choice([1, 7, 97, 4093]))
    core, ref = NgramModPool(n, size), NgramModPool(n, size)
    for _ in range(25):
        toks = rng.integers(0, int(rng.choice([2, 50, 49152])), int(rng.integers(0, 90))).astype(np.int32)
        start = int(rng.integers(0, len(toks) + 1))
        stop = int(rng.integers(0, len(toks) + 4))
        core.add_range(toks, start, stop)
        ref.add_range_reference(toks, start, stop)
        assert (core.entries is None) == (ref.entries is None)
        if core.entries is not None:
            assert np.array_equal(core.entries, ref.entries)
        assert core.used == ref.used
    assert ref.used > 0  # something was added


@pytest.mark.parametrize("seed", range(8))
def test_the_core_rolls_the_drafts_the_reference_rolls(seed):
    """Pools of repetitive texts (long drafts, cycles that run to the limit), windows seen and unseen, limits of 0
    to 70 and n_min below, at and above them: the same drafts, from the reference given the window's hash or not."""
    rng = np.random.default_rng(40 + seed)
    n = int(rng.choice([1, 2, 4, 24]))
    vocab = int(rng.choice([3, 20, 49152]))
    pool = NgramModPool(n, int(rng.choice([97, 4093, 65521])))
    period = rng.integers(0, vocab, int(rng.integers(n + 1, 40)))
    text = np.concatenate([np.tile(period, 4), rng.integers(0, vocab, 60)]).astype(np.int32)
    pool.add_range(text, 0, len(text) - n)
    drafted = 0
    for _ in range(80):
        end = int(rng.integers(n, len(text) + 1))
        window = text[end - n : end] if rng.random() < 0.8 else rng.integers(0, vocab, n).astype(np.int32)
        limit = int(rng.choice([0, 1, 3, 16, 70]))
        n_min = int(rng.choice([0, 1, limit, limit + 2, 48]))
        got = pool.roll(window, limit, n_min)
        assert got == pool.roll_reference(window, limit, n_min)
        assert got == pool.roll_reference(window, limit, n_min, pool.hash(window.tolist()))
        drafted += len(got)
    assert drafted > 0
    assert NgramModPool(n, 97).roll(text[:n], 8, 0) == []  # an empty pool: nothing allocated, nothing drafted


def test_the_core_hashes_as_llama_cpp():
    """The slot of a window is llama.cpp's `idx`: sum t_i * C**(n-1-i) mod 2**64, mod the pool's size (written out
    here, not taken from either implementation), also for token ids whose products wrap."""
    toks = np.array([49151, 7, 0, 123, 40000, 5], np.int32)
    n, size = 3, 1_000_003
    pool = NgramModPool(n, size)
    pool.add_range(toks, 0, 3)
    for i in range(3):
        h = 0
        for t in toks[i : i + n].tolist():
            h = (h * HASH_MUL + t) & MASK64
        assert pool.entries[h % size] == toks[i + n]
    assert pool.used == 3


def test_the_core_refuses_what_it_cannot_read():
    """Called directly with a range past the tokens, an empty window or another dtype, it raises instead of reading
    past a buffer."""
    core = pytest.importorskip("specray.engine.speculators._ngram_mod_core")
    entries = np.full(11, -1, np.int32)
    toks = np.arange(6, dtype=np.int32)
    with pytest.raises(ValueError):
        core.add(entries, toks, 0, 5, 2)  # stop > len(tokens) - n
    with pytest.raises(TypeError):
        core.add(entries, toks.astype(np.int64), 0, 2, 2)
    assert (entries == -1).all()
    with pytest.raises(ValueError):
        core.roll(entries, toks[:0], 4, 0)  # no window
    with pytest.raises(TypeError):
        core.roll(entries.astype(np.int64), toks[:2], 4, 0)


def test_the_speculator_drafts_alike_with_either():
    """Prompts added at set-up, emitted tokens added in chunks, a pool shared by several sequences: every draft is
    the same, and so is the pool."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 30, 200)
    texts = [np.concatenate([base[: 80 + 10 * s], rng.integers(0, 30, 60), base[20:140]]).astype(np.int32)
             for s in range(4)]
    out = {}
    for compiled in (True, False):
        NgramModPool.compiled = compiled
        try:
            spec = NgramModSpeculator(NgramModParams(n_match=4, n_min=2, n_max=16, pool_size=65_521))
            drafts = []
            for sid, text in enumerate(texts):
                spec.begin(sid, text[:60])
                for pos in range(60, len(text), 3):
                    (d,) = spec.draft([DraftRequest(sid, text[:pos], 16)])
                    drafts.append(d.tolist())
                spec.end(sid)
            out[compiled] = (drafts, spec.pool.entries.copy(), spec.pool.used)
        finally:
            NgramModPool.compiled = True
    assert out[True][0] == out[False][0]
    assert np.array_equal(out[True][1], out[False][1]) and out[True][2] == out[False][2]
    assert sum(map(len, out[True][0])) > 50  # it drafted
