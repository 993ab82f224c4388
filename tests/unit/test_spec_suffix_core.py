"""SuffixTrie.extend's and .advance_through's compiled core (engine/speculators/_suffix_core.c) against their
pure-Python references, SuffixTrie.extend_reference and .advance_through_reference: after every operation, two tries
grown alike hold the same contents, node for node, and a context advanced through either trie has the same states."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculator import DraftRequest
from specray.engine.speculators import suffix
from specray.engine.speculators.suffix import SuffixSpeculator, SuffixTrie

from ._spec_helpers import memory_growth


def test_the_core_is_built():
    """setup (pip install) builds it: a tree where it is missing would run every extend interpreted."""
    assert suffix.COMPILED_CORE, "not built: docs/troubleshooting.md, 'The compiled cores were not built'"


def _pair(depth: int) -> tuple[SuffixTrie, SuffixTrie]:
    return SuffixTrie(depth), SuffixTrie(depth, compiled=False)


@pytest.mark.parametrize("seed", range(12))
def test_the_core_grows_the_same_trie_as_the_reference(seed):
    """Random operations, as the per-request and global tries see them: sequences grown interleaved (prompts in
    one piece, generated tokens a few at a time), finished, removed whole or in slices, and the version bumped
    (freed nodes reused). Vocabularies from 2 tokens (deep repeats, leaf splits at max_depth) to 300."""
    rng = np.random.default_rng(seed)
    depth = int(rng.choice([2, 3, 4, 8, 16, 64]))
    vocab = int(rng.choice([2, 3, 5, 20, 300]))
    core, ref = _pair(depth)
    grown = peak = 0
    for step in range(60):
        sid = int(rng.integers(0, 5))
        r = rng.random()
        if r < 0.65:
            n = int(rng.integers(40, 200)) if rng.random() < 0.2 else int(rng.integers(0, 6))
            toks = rng.integers(0, vocab, n)
            core.extend(sid, toks.astype(np.int32))  # numpy ints in, Python ints stored
            ref.extend(sid, toks.tolist())
            grown += n
        elif r < 0.8 and sid in core.seqs:
            L = len(core.seqs[sid])
            a = int(rng.integers(0, L + 1))
            b = int(rng.integers(a, L + 1))
            core.remove_range(sid, a, b)
            ref.remove_range(sid, a, b)
        elif r < 0.88:
            core.remove(sid)
            ref.remove(sid)
        elif r < 0.95:
            core.finish(sid)
            ref.finish(sid)
        else:
            core.bump_version()
            ref.bump_version()
        assert core.contents() == ref.contents(), f"step {step}"
        peak = max(peak, core.n_nodes)
    assert grown > 100 and peak > 5  # there was a trie to compare


def _advanced(trie: SuffixTrie, states: list, tokens: list, compiled: bool):
    """advance_through's states, or the exception's type where it raised (a leaf of a sequence removed since)."""
    try:
        if compiled:
            return trie.advance_through(states, tokens)
        return trie.advance_through_reference(states, tokens)
    except KeyError as e:
        return type(e)


@pytest.mark.parametrize("seed", range(12))
def test_the_core_advances_as_the_reference(seed):
    """Contexts matched in a trie that grows, loses sequences and slices and reuses nodes (as the global trie
    does), advanced a few tokens at a time, re-matched from scratch and carried over removals (a state that refers
    to taken-out nodes walks them as before): the core's states are the reference's, step after step."""
    rng = np.random.default_rng(100 + seed)
    depth = int(rng.choice([2, 4, 8, 64]))
    vocab = int(rng.choice([2, 3, 8, 40]))
    trie = SuffixTrie(depth)
    contexts = [[] for _ in range(3)]  # each: its states, advanced through both ways and compared every step
    matched = 0
    for step in range(80):
        sid = int(rng.integers(0, 4))
        r = rng.random()
        if r < 0.6:
            trie.extend(sid, rng.integers(0, vocab, int(rng.integers(1, 40))).tolist())
        elif r < 0.75 and sid in trie.seqs:
            L = len(trie.seqs[sid])
            a = int(rng.integers(0, L + 1))
            trie.remove_range(sid, a, int(rng.integers(a, L + 1)))
        elif r < 0.85:
            trie.remove(sid)
        else:
            trie.bump_version()
        for c, states in enumerate(contexts):
            toks = rng.integers(0, vocab, int(rng.choice([1, 2, 5, 70]))).tolist()
            if sid in trie.seqs and rng.random() < 0.3:  # a passage the trie holds: long matches, leaves
                seq = trie.seqs[sid]
                a = int(rng.integers(0, len(seq) + 1))
                toks = seq[a : a + int(rng.integers(1, 12))] or toks
            if isinstance(states, type):
                states = []
            mine, ref = _advanced(trie, list(states), toks, True), _advanced(trie, list(states), toks, False)
            assert mine == ref, f"step {step}"
            contexts[c] = mine
            matched += isinstance(mine, list) and len(mine) > 1
        assert trie.match(toks) == trie.advance_through_reference([], toks[-depth:])
    assert matched > 20  # contexts matched suffixes longer than one token


def test_a_long_repeat_splits_leaves_at_every_depth():
    """A period-3 text, deeper than max_depth: every new token extends max_depth - 1 growing suffixes and splits
    leaves of its own sequence, the case where the core appends to a growing-suffix list it is walking."""
    core, ref = _pair(16)
    text = [1, 2, 3] * 40
    for t in (core, ref):
        t.extend(0, text[:7])
        for i in range(7, len(text), 5):
            t.extend(0, text[i : i + 5])
        t.extend(1, text[:30])
    assert core.contents() == ref.contents()
    assert len(core.active_states(0)) == 15 and core.count([1, 2, 3]) == 40 + 10


def test_the_speculator_drafts_alike_with_either():
    """A per-request and a global trie in use: every draft and its confidence are the same."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 30, 80)
    texts = [np.concatenate([base[: 40 + 5 * sid], rng.integers(0, 30, 40), base[:20]]) for sid in range(6)]
    out = {}
    for compiled in (True, False):
        SuffixTrie.compiled = compiled
        try:
            spec = SuffixSpeculator()
            drafts = []
            for sid, text in enumerate(texts):
                spec.begin(sid, text[:30].astype(np.int32))
                for pos in range(30, len(text), 3):
                    (d,) = spec.draft([DraftRequest(sid, text[:pos].astype(np.int32), 8)])
                    drafts.append((d.tolist(), [round(p, 9) for p in spec.last_confidence.get(sid, [])]))
                spec.end(sid)
            out[compiled] = drafts
        finally:
            SuffixTrie.compiled = True
    assert out[True] == out[False]
    assert sum(len(d) for d, _ in out[True]) > 20  # it drafted


def test_bad_input_is_refused_by_either():
    for compiled in (True, False):
        t = SuffixTrie(8, compiled=compiled)
        with pytest.raises(ValueError, match="sequence id"):
            t.extend(-1, [1, 2])
        with pytest.raises((TypeError, ValueError)):
            t.extend(0, ["a"])
        with pytest.raises((TypeError, ValueError)):
            t.advance_through([], ["a"])


def test_the_core_leaks_nothing():
    """Tries grown, matched, cut and dropped again and again hold no more Python memory than the first time: the core
    releases every object it makes or replaces (tracemalloc sees the objects a C extension allocates)."""
    rng = np.random.default_rng(8)
    texts = [rng.integers(0, 6, 300).tolist() for _ in range(12)]

    def grow_and_drop() -> None:
        t = SuffixTrie(16)
        for i, x in enumerate(texts):
            for j in range(0, len(x), 37):
                t.extend(i, x[j : j + 37])
                t.match(x[: j + 37])
            if i >= 3:
                t.remove(i - 3)
                t.bump_version()

    assert memory_growth(grow_and_drop) < 4096


def _picks_compared(spec: SuffixSpeculator, sid: int, n_max: int) -> tuple[int, int]:
    """The compiled pick and the reference on one sequence's state: the same walk (tokens, probabilities, score,
    match, trie, state, budget). Returns (1 if it drafted, 1 if the walk was the global trie's)."""
    st = spec._seqs[sid]
    mine, ref = spec._pick(st, n_max), spec._pick_reference(st, n_max)
    if ref is None:
        assert mine is None
        return 0, 0
    assert (mine.tokens, mine.probs, mine.score, mine.match_len, mine.source, mine.state, mine.budget) == (
        ref.tokens, ref.probs, ref.score, ref.match_len, ref.source, ref.state, ref.budget)
    assert mine.trie is ref.trie
    return 1, int(ref.source == "global")


@pytest.mark.parametrize("seed", range(8))
def test_the_core_picks_the_walk_the_reference_picks(seed):
    """Sequences drafting beside a global trie that gains finished sequences and, kept small, evicts them (taken-out
    nodes, stale best children the pick rescans), over min_match 1-6, draft budgets that the match length, the
    trie's depth or n_max bounds, p_min 0-0.5 and vocabularies of 3 to 40 tokens: the compiled pick and the
    reference pick the same walk, from the sequence's own trie and from the global one."""
    rng = np.random.default_rng(60 + seed)
    params = suffix.SuffixParams(min_match=int(rng.integers(1, 7)), max_depth=int(rng.choice([8, 16, 64])),
                                 p_min=float(rng.choice([0.0, 0.1, 0.5])), max_draft=int(rng.choice([4, 32])),
                                 max_spec_factor=float(rng.choice([0.5, 1.0, 2.0])),
                                 max_spec_offset=float(rng.choice([-1.0, 0.0, 3.0])),
                                 global_max_seqs=int(rng.choice([2, 1000])), global_work_per_call=0)
    spec = SuffixSpeculator(params)
    vocab = int(rng.choice([3, 12, 40]))
    base = rng.integers(0, vocab, 120)
    drafted = from_global = 0
    for sid in range(10):
        text = np.concatenate([base[: int(rng.integers(10, 120))], rng.integers(0, vocab, 30), base[:40]])
        text = text.astype(np.int32)
        spec.begin(sid % 3, text[:10])
        for pos in range(10, len(text), int(rng.integers(1, 4))):
            spec.draft([DraftRequest(sid % 3, text[:pos], 16)])
            d, g = _picks_compared(spec, sid % 3, int(rng.choice([1, 5, 16])))
            drafted, from_global = drafted + d, from_global + g
        spec.end(sid % 3)
    assert drafted > 20 and from_global > 0


def test_the_compiled_pick_leaks_nothing():
    rng = np.random.default_rng(9)
    spec = SuffixSpeculator(suffix.SuffixParams(min_match=2, global_work_per_call=0))
    text = np.tile(rng.integers(0, 8, 40), 4).astype(np.int32)
    spec.begin(0, text[:100])
    spec.draft([DraftRequest(0, text[:100], 16)])
    st = spec._seqs[0]
    assert spec._pick(st, 16) is not None

    def picks() -> None:
        for _ in range(50):
            spec._pick(st, 16)

    assert memory_growth(picks) < 4096
