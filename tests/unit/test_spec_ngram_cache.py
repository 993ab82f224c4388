"""ngram_cache: context / dynamic / static n-gram count tables (llama.cpp ngram-cache)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from specray.engine.speculators.ngram_cache import (
    MIN_PERCENT_LAX,
    MIN_PERCENT_STRICT,
    MIN_SAMPLE_LAX,
    MIN_SAMPLE_STRICT,
    NGRAM_MAX,
    NgramCacheParams,
    NgramCacheSpeculator,
    NgramCountTable,
    build_static_cache,
    entry_counts,
    entry_summary,
    ngram_cache_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle


def table(*seqs, lo=1, hi=4):
    t = NgramCountTable()
    for s in seqs:
        t.update(arr(*s), 0, lo, hi)
    return t


def brute_counts(seq, ngram):
    k = len(ngram)
    out = {}
    for i in range(k, len(seq)):
        if list(seq[i - k : i]) == list(ngram):
            out[seq[i]] = out.get(seq[i], 0) + 1
    return out


def test_update_counts_and_incremental():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 4, 80).astype(np.int32)
    full = NgramCountTable()
    full.update(seq)
    inc = NgramCountTable()
    pos = 0
    while pos < len(seq):
        nxt = min(len(seq), pos + int(rng.integers(1, 5)))
        inc.update(seq[:nxt], pos)
        pos = nxt
    assert full.table.keys() == inc.table.keys()
    for key in full.table:
        ng = np.frombuffer(key, np.int32).tolist()
        assert full.counts(ng) == inc.counts(ng) == brute_counts(seq.tolist(), ng)
        counts = entry_counts(full.table[key])
        total, best_count, best_token = entry_summary(full.table[key])
        assert total == sum(counts.values()) and best_count == max(counts.values()) == counts[best_token]


def test_entries_are_not_tracked_by_the_garbage_collector(tmp_path):
    """A long-running server's tables hold hundreds of thousands of entries: none of them may be an object the
    cyclic collector walks, however the entry was made (counted, merged, loaded)."""
    rng = np.random.default_rng(3)
    a, b = NgramCountTable(), NgramCountTable()
    a.update(rng.integers(0, 30, 400).astype(np.int32))
    b.update(rng.integers(0, 30, 400).astype(np.int32))
    a.add(arr(7, 7).tobytes(), 5, 3)
    a.merge(b)
    a.save(tmp_path / "t.bin")
    loaded = NgramCountTable.load(tmp_path / "t.bin")
    for t in (a, loaded):
        assert len(t) > 100
        assert not any(gc.is_tracked(e) for e in t.table.values())
        assert all(min(entry_counts(e)) >= 0 and sum(entry_counts(e).values()) == entry_summary(e)[0]
                   for e in t.table.values())


def test_a_negative_next_token_is_refused():
    raw = np.array([1, 2, -1, -1, 1, -5, 3], np.int32).tobytes()  # n-gram [1 2], one next token: -5, count 3
    with pytest.raises(ValueError, match="negative token"):
        NgramCountTable.from_bytes(raw)
    with pytest.raises(ValueError, match="token id"):
        NgramCountTable().add(arr(1, 2).tobytes(), -2)


def test_context_lax_thresholds():
    # 1-gram [5]: -> 6 twice, -> 7 once: 3 samples, 66.7 % >= 66 %: drafts 6
    ctx = table([5, 6, 5, 6, 5, 7, 1, 5])
    assert ngram_cache_draft(arr(1, 5), 1, ctx).tolist() == [6]
    # 1-gram [5]: 6 once, 7 once: 50 % < 66 %: nothing ([1 5] is new)
    ctx = table([5, 6, 5, 7, 1, 5])
    assert ngram_cache_draft(arr(1, 5), 1, ctx).tolist() == []
    # a 1-gram seen once is below the minimum sample size 2
    ctx = table([5, 6])
    assert ngram_cache_draft(arr(1, 5), 1, ctx).tolist() == []
    # a 3-gram seen once is enough (lax: 1 sample, 50 %)
    ctx = table([1, 2, 5, 6])
    assert ngram_cache_draft(arr(1, 2, 5), 1, ctx).tolist() == [6]


def test_longest_ngram_first():
    # [1] -> 2 x3, 4 x1 (75 %); [8 9 1] -> 4 once; [9 1] -> 4 once (too few for a 2-gram)
    ctx = table([1, 2, 1, 2, 1, 2, 8, 9, 1, 4])
    assert ngram_cache_draft(arr(8, 9, 1), 1, ctx).tolist() == [4]  # the 3-gram wins
    assert ngram_cache_draft(arr(7, 9, 1), 1, ctx).tolist() == [2]  # falls back to the 1-gram


def test_dynamic_strict_thresholds_after_context():
    empty = NgramCountTable()
    dyn = table([3, 4, 8, 3, 4, 8, 3, 4, 9])  # [3 4] -> 8 x2, 9 x1: 3 samples, 66.7 %
    assert ngram_cache_draft(arr(3, 4), 1, empty, dyn).tolist() == [8]
    dyn2 = table([3, 4, 8, 3, 4, 8])  # 2 samples < strict minimum 3 for 2-grams
    assert ngram_cache_draft(arr(3, 4), 1, empty, dyn2).tolist() == []
    # the lax context table wins over the dynamic one
    ctx = table([3, 4, 5])
    ctx.update(arr(0, 3, 4, 5), 0, 3, 3)
    assert ngram_cache_draft(arr(0, 3, 4), 1, ctx, dyn).tolist() == [5]


def test_static_weighting_and_fallback():
    # [1 2] -> 8 once, 7 once: unweighted the first to reach the top count (8) wins
    ctx = table([1, 2, 8, 1, 2, 7])
    assert ngram_cache_draft(arr(1, 2), 1, ctx).tolist() == [8]
    # a static table that knows [1 2] -> 7 weights 7 by 100 x its static count
    static = build_static_cache(arr(1, 2, 7))
    assert set(static.table) == {arr(1, 2).tobytes()}  # 2-grams only
    assert ngram_cache_draft(arr(1, 2), 1, ctx, None, static).tolist() == [7]
    # weighting can make an entry fail: [1 2] -> 8 x2, 7 x1 picks 7 (1 x 100 > 2 x 1),
    # 33 % < 50 %; the 1-gram [2] fails the same way; the static table alone has 1 sample
    ctx2 = table([1, 2, 7, 1, 2, 8, 1, 2, 8])
    assert ngram_cache_draft(arr(1, 2), 1, ctx2).tolist() == [8]
    assert ngram_cache_draft(arr(1, 2), 1, ctx2, None, static).tolist() == []
    # ... while a static table with 2 samples drafts on its own as the last resort
    static2 = build_static_cache(arr(1, 2, 7, 1, 2, 7))
    assert ngram_cache_draft(arr(1, 2), 1, ctx2, None, static2).tolist() == [7]
    # nothing in context or dynamic: static only (2-gram lookups, >= 2 samples, >= 50 %)
    static3 = build_static_cache(arr(1, 2, 7, 1, 2, 7, 1, 2, 7))
    assert ngram_cache_draft(arr(9, 1, 2), 5, NgramCountTable(), None, static3).tolist() == [7, 1, 2, 7, 1]


def test_multi_token_draft_uses_drafted_tokens_as_context():
    h = arr(5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2)
    ctx = table(h.tolist())
    assert ngram_cache_draft(h, 4, ctx).tolist() == [3, 9, 1, 2]
    assert ngram_cache_draft(h, 2, ctx).tolist() == [3, 9]  # n_draft caps


def test_empty_and_short():
    ctx = NgramCountTable()
    assert ngram_cache_draft(arr(), 4, ctx).tolist() == []
    assert ngram_cache_draft(arr(1), 4, table([1, 2, 1, 2])).tolist() == []  # < 2 tokens
    assert ngram_cache_draft(arr(1, 2), 0, table([1, 2, 1, 2])).tolist() == []


def test_file_format_is_llama_cpp(tmp_path):
    t = NgramCountTable()
    t.add(arr(11, 12).tobytes(), 13, 3)
    path = tmp_path / "one.bin"
    t.save(path)
    raw = np.fromfile(path, dtype=np.int32).tolist()
    # common_ngram (4 tokens, -1 padded), ntokens, (token, count) pairs
    assert raw == [11, 12, -1, -1, 1, 13, 3]


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    t = NgramCountTable()
    t.update(rng.integers(0, 50, 500).astype(np.int32))
    t.add(arr(1, 2, 3, 4).tobytes(), 2**31 - 1, 1)  # large token ids survive
    path = tmp_path / "cache.bin"
    t.save(path)
    u = NgramCountTable.load(path)
    assert len(u) == len(t)
    for key, e in t.table.items():
        f = u.table[key]
        assert entry_counts(f) == entry_counts(e) and entry_summary(f)[:2] == entry_summary(e)[:2]
    with pytest.raises(ValueError):
        NgramCountTable.from_bytes(path.read_bytes()[:-4])  # truncated


def test_dynamic_accumulates_across_sequences_and_persists(tmp_path):
    path = tmp_path / "dyn.bin"
    # keep_finished 0: each table is merged at its sequence's end (kept ones are merged when they leave)
    sp = NgramCacheSpeculator(NgramCacheParams(n_draft=3, dynamic_path=str(path), keep_finished=0))
    assert len(sp.dynamic) == 0
    for seq_id in (0, 1, 2):  # three sequences that all say "4 5 -> 6"
        sp.begin(seq_id, arr(4, 5, 6, 0))
        draft1(sp, seq_id, arr(4, 5, 6, 0, 9))
        sp.end(seq_id)
    assert sp.dynamic.counts([4, 5]) == {6: 3}
    # a fresh sequence whose own context knows nothing drafts from dynamic (strict: 3 samples)
    sp.begin(3, arr(8, 8))
    assert draft1(sp, 3, arr(8, 8, 4, 5))[:1].tolist() == [6]
    assert sp.save() == str(path)
    # loaded at construction
    sp2 = NgramCacheSpeculator(NgramCacheParams(n_draft=3, dynamic_path=str(path)))
    assert sp2.dynamic.counts([4, 5]) == {6: 3}
    assert draft1(sp2, 0, arr(8, 8, 4, 5))[:1].tolist() == [6]
    # save without a path
    with pytest.raises(ValueError):
        NgramCacheSpeculator().save()


def test_static_path_and_dynamic_bound(tmp_path):
    spath = tmp_path / "static.bin"
    build_static_cache(arr(3, 1, 3, 1, 3, 1)).save(spath)
    sp = NgramCacheSpeculator(NgramCacheParams(n_draft=4, static_path=str(spath), dynamic_max_ngrams=5))
    assert draft1(sp, 0, arr(7, 3, 1)).tolist() == [3, 1, 3, 1]
    sp.end(0)
    assert len(sp.dynamic) <= 5
    with pytest.raises(FileNotFoundError):
        NgramCacheSpeculator(NgramCacheParams(static_path=str(tmp_path / "missing.bin")))


def test_per_sequence_context_isolation():
    sp = NgramCacheSpeculator(NgramCacheParams(update_dynamic=False))
    sp.begin(0, arr(1, 2, 3, 1, 2, 3))
    sp.begin(1, arr(9, 9))
    assert draft1(sp, 0, arr(1, 2, 3, 1, 2, 3, 1, 2))[:1].tolist() == [3]
    assert len(draft1(sp, 1, arr(9, 9, 1, 2))) == 0
    sp.end(0)
    assert len(sp.dynamic) == 0  # update_dynamic=False


def test_rebuild_on_reused_seq_id():
    sp = NgramCacheSpeculator()
    assert draft1(sp, 0, arr(1, 2, 3, 1, 2, 3, 1, 2))[:1].tolist() == [3]
    assert len(draft1(sp, 0, arr(8, 2))) == 0  # shorter: context rebuilt from [8 2]
    assert sp._seqs[0].context.counts([1]) == {}


def test_state_roundtrip():
    sp = NgramCacheSpeculator()
    sp.begin(0, arr(4, 5, 6))
    sp.prefilling(0, 3)  # the target prefilled the prompt: counted
    sp.end(0)
    sp2 = NgramCacheSpeculator()
    sp2.set_state(sp.get_state())
    assert sp2.dynamic.counts([4, 5]) == {6: 1}


def test_lifecycle_and_stats():
    rng = np.random.default_rng(6)
    block = rng.integers(100, 200, 40).tolist()
    prompt = rng.integers(0, 50, 20).tolist() + block + [7]
    sp = NgramCacheSpeculator(NgramCacheParams(n_draft=6))
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=6)
    assert mine["tok_acc"] > 20
    check_stats(sp, mine)
    # its table is kept for a request that continues it; merged into the dynamic table once it is not
    assert len(sp.kept) == 1 and len(sp.dynamic) == 0
    sp.merge_kept()
    assert len(sp.kept) == 0 and len(sp.dynamic) > 0


class DictEntries:
    """The reference: every entry a dict of its next tokens' counts, its leader the first token to reach the top
    count (llama.cpp's rule, as add() and merge() keep it), whether the n-gram was seen once or many times."""

    def __init__(self):
        self.entries: dict[bytes, dict] = {}  # key -> {"counts": {token: count}, "best": token}

    def add(self, key, token, count=1):
        e = self.entries.setdefault(key, {"counts": {}, "best": None})
        c = e["counts"][token] = e["counts"].get(token, 0) + count
        if e["best"] is None or c > e["counts"][e["best"]]:
            e["best"] = token

    def update(self, tokens, start=0, lo=1, hi=4):
        toks = [int(t) for t in tokens]
        for i in range(max(start, lo), len(toks)):
            for s in range(lo, min(hi, i) + 1):
                self.add(arr(*toks[i - s : i]).tobytes(), toks[i])

    def merge(self, other):
        for key, e in other.entries.items():
            for token, count in e["counts"].items():  # in the order the other table first saw them
                self.add(key, token, count)
        other.entries = {}

    def summary(self, key):
        e = self.entries[key]
        return sum(e["counts"].values()), e["counts"][e["best"]], e["best"]


def same_as_reference(t: NgramCountTable, ref: DictEntries) -> None:
    assert t.table.keys() == ref.entries.keys()
    for key, e in t.table.items():
        assert entry_counts(e) == ref.entries[key]["counts"]
        assert entry_summary(e) == ref.summary(key)
        # an n-gram seen once is the int of its token; a dict from the second occurrence on
        assert isinstance(e, int) == (ref.summary(key)[0] == 1)


def test_once_seen_entries_count_and_merge_as_dict_entries_do():
    """Random texts over small vocabularies (many repeats) and large ones (mostly once-seen n-grams), counted in
    increments and merged table into table, every combination of once-seen and repeated entries on both sides:
    every entry's counts, total, best count and leader equal the dict-per-entry reference's, and drafts made from
    the tables are the same as from tables rebuilt from those counts alone (the file format)."""
    rng = np.random.default_rng(11)
    for vocab in (3, 12, 400):
        tables, refs = [], []
        for _ in range(4):
            seq = rng.integers(0, vocab, int(rng.integers(5, 120))).astype(np.int32)
            t, ref = NgramCountTable(), DictEntries()
            pos = 0
            while pos < len(seq):
                nxt = min(len(seq), pos + int(rng.integers(1, 9)))
                t.update(seq[:nxt], pos)
                ref.update(seq[:nxt], pos)
                pos = nxt
            same_as_reference(t, ref)
            tables.append(t)
            refs.append(ref)
        merged, ref = tables[0], refs[0]
        for t, r in zip(tables[1:], refs[1:]):
            merged.merge(t)
            ref.merge(r)
            same_as_reference(merged, ref)
            assert len(t) == 0
        key = arr(int(rng.integers(0, vocab))).tobytes()
        merged.add(key, np.int32(vocab + 1))  # a numpy id is stored as a Python int
        ref.add(key, vocab + 1)
        same_as_reference(merged, ref)
        for _ in range(20):
            h = rng.integers(0, vocab, int(rng.integers(2, 12))).astype(np.int32)
            assert ngram_cache_draft(h, 6, merged).tolist() == reference_draft(h, 6, ref)
            assert ngram_cache_draft(h, 6, NgramCountTable(), merged).tolist() == reference_draft(h, 6, None, ref)
        # a file keeps counts, not which token reached a tied top count first: a reloaded leader is one of them
        reloaded = NgramCountTable.from_bytes(merged.to_bytes())
        assert reloaded.table.keys() == ref.entries.keys()
        for key, e in reloaded.table.items():
            counts = ref.entries[key]["counts"]
            total, top, leader = entry_summary(e)
            assert entry_counts(e) == counts and (total, top) == ref.summary(key)[:2] and counts[leader] == top
            assert isinstance(e, int) == (total == 1)


def reference_draft(h, n_draft, context: DictEntries | None, dynamic: DictEntries | None = None) -> list[int]:
    """llama.cpp's draft rule over the reference's entries: per token, the context table (lax thresholds), then
    the dynamic one (strict), each from the longest n-gram down; an entry qualifies on its total and its
    leader's share."""
    def primary(ref, toks, min_sample, min_percent):
        for size in range(min(NGRAM_MAX, len(toks)), 0, -1):
            key = arr(*toks[-size:]).tobytes()
            if ref is None or key not in ref.entries:
                continue
            total, top, leader = ref.summary(key)
            if total >= min_sample[size - 1] and 100 * top >= min_percent[size - 1] * total:
                return leader
        return None

    toks, out = [int(t) for t in h], []
    while len(out) < n_draft and len(toks) >= 2:
        tok = primary(context, toks, MIN_SAMPLE_LAX, MIN_PERCENT_LAX)
        if tok is None:
            tok = primary(dynamic, toks, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT)
        if tok is None:
            break
        out.append(tok)
        toks.append(tok)
    return out


def test_a_static_2gram_seen_once_weights_as_a_counted_one():
    # the static table has [1 2] -> 7 once (an int entry): 7 is weighted 100 x 1 over [1 2] -> 8 twice
    static = build_static_cache(arr(1, 2, 7))
    assert static.table[arr(1, 2).tobytes()] == 7
    ctx = table([1, 2, 8, 1, 2, 8, 1, 2, 7])
    assert ngram_cache_draft(arr(0, 1, 2), 1, ctx, None, static).tolist() == []  # 7: 1 of 3 < 50 %
    ctx = table([1, 2, 7, 5, 1, 2, 7])
    assert ngram_cache_draft(arr(0, 1, 2), 1, ctx, None, static).tolist() == [7]


def test_doctests():
    import doctest

    from specray.engine.speculators import ngram_cache

    failed, attempted = doctest.testmod(ngram_cache)
    assert attempted > 10 and failed == 0
