"""NgramCountTable.update's and .merge's and ngram_cache_draft's compiled core (engine/speculators/_ngram_core.c)
against their pure-Python references, update_reference, merge_reference and ngram_cache_draft_reference: tables
counted and merged alike hold the same entries, in the same order, with the same keys in each entry in the same order
(a file written from either is the same file), and the same tables draft the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculator import DraftRequest
from specray.engine.speculators import ngram_cache
from specray.engine.speculators.ngram_cache import (NgramCacheParams, NgramCacheSpeculator, NgramCountTable,
                                                    ngram_cache_draft, ngram_cache_draft_reference)

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


@pytest.mark.parametrize("seed", range(10))
def test_the_core_drafts_what_the_reference_drafts(seed):
    """Context and dynamic tables of texts over 2 to 40 tokens (every threshold passes and fails somewhere: once-seen
    ints, dicts with a clear and a split lead, the strict rule's larger samples), histories of 0 to 5 tokens and
    longer, context tables counted over the history or over half of it and other text, drafts of 0 to 60 tokens:
    the compiled walk drafts what the reference drafts, with and without a dynamic table."""
    rng = np.random.default_rng(70 + seed)
    vocab = int(rng.choice([2, 3, 8, 40]))
    dynamic = NgramCountTable()
    for _ in range(4):
        t = NgramCountTable()
        t.update(rng.integers(0, vocab, 200).astype(np.int32))
        dynamic.merge(t)
    drafted = 0
    for _ in range(60):
        n_h = int(rng.choice([0, 1, 2, 3, 5, 40, 120]))
        seg = rng.integers(0, vocab, 30)  # a passage the history repeats in part: its end has been seen before
        text = np.concatenate([seg, rng.integers(0, vocab, 10), seg[: int(rng.integers(1, 30))]])
        h = text[len(text) - min(n_h, len(text)) :]
        h = np.concatenate([rng.integers(0, vocab, n_h - len(h)), h]).astype(np.int32)
        # the history's own counts, or its first half's and other text's (a walk there can run into a dead end)
        other = np.concatenate([h[: len(h) // 2], rng.integers(0, vocab, 30)]).astype(np.int32)
        context = NgramCountTable()
        context.update(h if rng.random() < 0.5 else other)
        n = int(rng.choice([0, 1, 4, 12, 60]))
        for dyn in (None, NgramCountTable(), dynamic):
            mine, ref = ngram_cache_draft(h, n, context, dyn), ngram_cache_draft_reference(h, n, context, dyn)
            assert mine.dtype == ref.dtype == np.int32
            assert mine.tolist() == ref.tolist()
            drafted += len(mine) > 0
    assert drafted > 5  # (over 40 tokens few histories end in an n-gram seen before)


def test_the_core_stops_where_the_reference_stops():
    """A walk that runs into a dead end (6 was never followed) ends there, before its budget, in both."""
    context = NgramCountTable()
    context.update(np.array([1, 2, 3, 4, 5, 6], np.int32))
    h = np.array([9, 1, 2, 3], np.int32)
    assert ngram_cache_draft(h, 8, context).tolist() == [4, 5, 6]
    assert ngram_cache_draft_reference(h, 8, context).tolist() == [4, 5, 6]


def test_a_static_table_drafts_with_the_reference():
    """The compiled walk leaves static weighting to the reference: with a static table both functions draft the
    same, and the static table's 2-grams decide (the last resort no other table reaches)."""
    static = NgramCountTable()
    static.update(np.array([1, 2, 3, 1, 2, 3, 1, 2, 3], np.int32), ngram_min=2, ngram_max=2)
    h = np.array([7, 1, 2], np.int32)
    context = NgramCountTable()
    context.update(h)
    assert ngram_cache_draft(h, 3, context, None, static).tolist() == [3, 1, 2]
    assert ngram_cache_draft_reference(h, 3, context, None, static).tolist() == [3, 1, 2]
    assert ngram_cache_draft(h, 3, context).tolist() == []  # without it nothing qualifies


def test_the_core_draft_refuses_a_tail_that_is_not_the_historys_end():
    from specray.engine.speculators._ngram_core import draft

    h = np.array([1, 2, 1, 2, 1, 2], np.int32)
    t = NgramCountTable()
    t.update(h)
    assert draft(t.table, None, h[-4:].tobytes(), 6, 2) == [1, 2] == ngram_cache_draft_reference(h, 2, t).tolist()
    with pytest.raises(ValueError, match="last min"):
        draft(t.table, None, np.array([1, 2], np.int32).tobytes(), 9, 2)  # 4 tokens expected
    with pytest.raises(ValueError, match="last min"):
        draft(t.table, None, b"\x01\x02\x03", 1, 2)  # not whole int32s
    with pytest.raises(TypeError, match="dict or None"):
        draft(t.table, [], np.array([1, 2], np.int32).tobytes(), 2, 2)


def test_a_numpy_token_is_stored_as_a_python_int():
    t = NgramCountTable()
    t.update(np.array([5, 6, 5, 6], np.int32))
    assert all(type(k) is int for e in t.table.values() for k in ([e] if e.__class__ is int else e))


def test_the_core_leaks_nothing():
    """Tables counted, drafted from, merged and dropped again and again hold no more Python memory than the first time
    (tracemalloc sees the objects a C extension allocates)."""
    rng = np.random.default_rng(9)
    texts = [rng.integers(0, 6, 300).astype(np.int32) for _ in range(12)]

    def count_and_drop() -> None:
        dynamic = NgramCountTable()
        for x in texts:
            context = NgramCountTable()
            context.update(x[:150])
            context.update(x, 150)
            for n in range(2, 300, 7):
                ngram_cache_draft(x[:n], 8, context, dynamic)
            dynamic.merge(context)

    assert memory_growth(count_and_drop) < 4096
