"""NgramCountTable.update's and .merge's compiled core (engine/speculators/_ngram_core.c) against their pure-Python
references, update_reference and merge_reference: tables counted and merged alike hold the same entries, in the same
order, with the same keys in each entry in the same order (a file written from either is the same file)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculator import DraftRequest
from specray.engine.speculators import ngram_cache
from specray.engine.speculators.ngram_cache import NgramCacheParams, NgramCacheSpeculator, NgramCountTable

from ._spec_helpers import memory_growth


def test_the_core_is_built():
    """setup (pip install) builds it: a tree where it is missing would count every n-gram interpreted."""
    assert ngram_cache.COMPILED_CORE, "not built: docs/troubleshooting.md, 'The compiled cores were not built'"


def layout(t: NgramCountTable) -> list:
    """Every entry with its keys in order: what equal tables with different insertion orders would not share."""
    return [(k, e if e.__class__ is int else list(e.items())) for k, e in t.table.items()]


@pytest.mark.parametrize("seed", range(10))
def test_the_core_counts_the_same_table_as_the_reference(seed):
    """Texts over vocabularies of 2 to 400 tokens counted in increments (prompt chunks, a few emitted tokens at a
    time, a recount from an earlier start), n-gram sizes 1-4 and 2-3: once-seen ints, second occurrences and
    dicts whose leader changes all come up."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([2, 3, 12, 400]))
    lo, hi = (1, 4) if seed % 2 == 0 else (2, 3)
    core, ref = NgramCountTable(), NgramCountTable()
    toks = np.zeros(0, np.int32)
    for _ in range(30):
        n0 = len(toks)
        toks = np.concatenate([toks, rng.integers(0, vocab, int(rng.integers(0, 60))).astype(np.int32)])
        start = n0 if rng.random() < 0.85 else int(rng.integers(0, len(toks) + 1))
        core.update(toks, start, lo, hi)
        ref.update_reference(toks, start, lo, hi)
        assert layout(core) == layout(ref)
    assert sum(e.__class__ is dict for e in core.table.values()) > 3  # repeated n-grams were counted


def counted(seed: int, vocab: int, n: int) -> tuple[NgramCountTable, NgramCountTable]:
    """Two equal tables (by the reference) of a random text: one to merge with the core, one with the reference."""
    toks = np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)
    a, b = NgramCountTable(), NgramCountTable()
    a.update_reference(toks)
    b.update_reference(toks)
    return a, b


@pytest.mark.parametrize("seed", range(8))
def test_the_core_merges_as_the_reference(seed):
    """A dynamic table that merges sequence after sequence: once-seen into once-seen, into a dict, a dict into a
    once-seen entry and into a dict, and entries the dynamic table lacks (taken as they are)."""
    rng = np.random.default_rng(50 + seed)
    vocab = int(rng.choice([2, 4, 12, 300]))
    core, ref = NgramCountTable(), NgramCountTable()
    kinds = set()
    for k in range(12):
        a, b = counted(1000 * seed + k, vocab, int(rng.integers(0, 120)))
        for key, e in a.table.items():
            m = core.table.get(key)
            kinds.add((m.__class__.__name__, e.__class__.__name__))
        core.merge(a)
        ref.merge_reference(b)
        assert len(a) == len(b) == 0  # taken
        assert layout(core) == layout(ref)
    if vocab in (4, 12):  # every pairing of entry kinds came up (with 2 tokens every n-gram repeats at once)
        assert {("NoneType", "int"), ("int", "int"), ("int", "dict"), ("dict", "int"), ("dict", "dict")} <= kinds


def test_a_table_does_not_merge_into_itself():
    t, _ = counted(1, 5, 30)
    with pytest.raises(ValueError, match="into itself"):
        t.merge(t)


@pytest.mark.parametrize("keep", [0, 16])
def test_the_speculator_drafts_alike_with_either(keep):
    """Context, dynamic and kept tables in use over several sequences (keep 0: every sequence merged into the
    dynamic table at its end, which the next ones draft from): every draft is the same."""
    rng = np.random.default_rng(4)
    base = rng.integers(0, 20, 60)
    texts = [np.concatenate([base[: 30 + 4 * s], rng.integers(0, 20, 30), base[:25]]).astype(np.int32)
             for s in range(6)]
    out = {}
    for compiled in (True, False):
        NgramCountTable.compiled = compiled
        try:
            spec = NgramCacheSpeculator(NgramCacheParams(keep_finished=keep))
            drafts = []
            for sid, text in enumerate(texts):
                spec.begin(sid, text[:20])
                spec.prefilling(sid, 20)
                for pos in range(20, len(text), 2):
                    (d,) = spec.draft([DraftRequest(sid, text[:pos], 8)])
                    drafts.append(d.tolist())
                spec.end(sid)
            spec.merge_kept()
            out[compiled] = (drafts, layout(spec.dynamic))
        finally:
            NgramCountTable.compiled = True
    assert out[True] == out[False]
    assert sum(map(len, out[True][0])) > 20  # it drafted


def test_a_numpy_token_is_stored_as_a_python_int():
    t = NgramCountTable()
    t.update(np.array([5, 6, 5, 6], np.int32))
    assert all(type(k) is int for e in t.table.values() for k in ([e] if e.__class__ is int else e))


def test_the_core_leaks_nothing():
    """Tables counted, merged and dropped again and again hold no more Python memory than the first time
    (tracemalloc sees the objects a C extension allocates)."""
    rng = np.random.default_rng(9)
    texts = [rng.integers(0, 6, 300).astype(np.int32) for _ in range(12)]

    def count_and_drop() -> None:
        dynamic = NgramCountTable()
        for x in texts:
            context = NgramCountTable()
            context.update(x[:150])
            context.update(x, 150)
            dynamic.merge(context)

    assert memory_growth(count_and_drop) < 4096
