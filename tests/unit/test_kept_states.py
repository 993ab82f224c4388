"""Finished sequences' indexes kept for the requests that continue them (engine/speculators/kept_states.py): a
conversation's next turn starts from its last turn's index and indexes only the new tokens, which must leave the
speculator drafting exactly as it would after indexing the whole prompt afresh."""

from __future__ import annotations

import doctest

import numpy as np

from ._spec_helpers import arr, draft1
from specray.engine.speculators import kept_states
from specray.engine.speculators.kept_states import KeptStates
from specray.engine.speculators.ngram_cache import NgramCacheParams, NgramCacheSpeculator
from specray.engine.speculators.suffix import SuffixParams, SuffixSpeculator


def test_doctests():
    failed, attempted = doctest.testmod(kept_states)
    assert attempted > 0 and failed == 0


def _turns(seed: int):
    """A conversation of three turns, each prompt = the last turn's history + a few new tokens, over a small
    vocabulary with repeated spans (so both speculators find matches), and what each turn generates."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, int(rng.integers(3, 9))).tolist() for _ in range(6)]

    def text(n):
        out = []
        while len(out) < n:
            out += phrases[int(rng.integers(0, len(phrases)))] if rng.random() < 0.7 else [int(rng.integers(0, 40))]
        return out[:n]

    history = text(60)
    turns = []
    for _ in range(3):
        prompt = history + text(int(rng.integers(5, 20)))
        generated = text(30)
        turns.append((prompt, generated))
        history = prompt + generated
    return turns


def _run(spec, turns, probes):
    """Each turn: begin on its prompt, draft token by token through what it generates (the drafts are returned),
    end. `probes`: every draft after that many tokens of each turn is recorded."""
    drafts = []
    for seq_id, (prompt, generated) in enumerate(turns):
        spec.begin(seq_id % 2, arr(*prompt))
        h = list(prompt)
        for i, t in enumerate(generated):
            d = draft1(spec, seq_id % 2, arr(*h), n_max=8)
            if i % probes == 0:
                drafts.append(d.tolist())
            h.append(t)
        spec.end(seq_id % 2)
    return drafts


def test_suffix_continues_a_kept_trie_and_drafts_as_from_scratch():
    for seed in range(6):
        turns = _turns(seed)
        kept = SuffixSpeculator(SuffixParams(global_work_per_call=0))
        fresh = SuffixSpeculator(SuffixParams(global_work_per_call=0, keep_finished=0))
        assert _run(kept, turns, 3) == _run(fresh, turns, 3)
        # turns 2 and 3 each started from the last turn's trie: the last turn's history was not inserted again
        assert kept.kept.taken == kept.stats.continued == 2 and fresh.kept.taken == fresh.stats.continued == 0
        assert kept.stats.continued_tokens == kept.kept.tokens_saved
        assert kept.kept.tokens_saved == len(turns[0][0]) + len(turns[0][1]) - 1 + len(turns[1][0]) + len(
            turns[1][1]) - 1


def test_ngram_cache_continues_a_kept_table_and_counts_as_from_scratch():
    for seed in range(6):
        turns = _turns(seed)
        # no dynamic table: a kept table reaches it later than a merged one, which changes what it drafts from
        kept = NgramCacheSpeculator(NgramCacheParams(n_draft=6, update_dynamic=False))
        fresh = NgramCacheSpeculator(NgramCacheParams(n_draft=6, update_dynamic=False, keep_finished=0))
        assert _run(kept, turns, 2) == _run(fresh, turns, 2)
        assert kept.kept.taken == 2
        # the last turn's table, continued, is what counting its whole prompt afresh gives
        last = arr(*turns[2][0], *turns[2][1][:-1])
        assert kept.kept.take(last).context.table == _counted(last)


def _counted(tokens: np.ndarray) -> dict:
    """The context table of `tokens` counted from scratch."""
    sp = NgramCacheSpeculator(NgramCacheParams(update_dynamic=False))
    sp.begin(0, tokens)
    sp.prefilling(0, len(tokens))
    sp.end(0)
    return sp.kept.take(tokens).context.table


def test_a_kept_table_reaches_the_dynamic_table_when_it_leaves():
    sp = NgramCacheSpeculator(NgramCacheParams(keep_finished=2))
    for seq_id in range(3):  # three unrelated sequences: the first leaves the kept ones when the third ends
        prompt = arr(100 + seq_id, 4, 5, 6, 4, 5, 6)
        sp.begin(seq_id, prompt)
        draft1(sp, seq_id, prompt)
        sp.end(seq_id)
    assert len(sp.kept) == 2 and sp.dynamic.counts([4, 5]) == {6: 2}
    sp.merge_kept()  # as save() and get_state() do
    assert len(sp.kept) == 0 and sp.dynamic.counts([4, 5]) == {6: 6}


def test_the_bounds():
    kept = KeptStates(max_states=3, max_tokens=10, on_drop=(dropped := []).append)
    kept.put(arr(1, 2, 3, 4), "a")
    kept.put(arr(5, 6, 7, 8), "b")
    kept.put(arr(9, 9, 9), "c")  # 11 tokens: the oldest goes
    assert dropped == ["a"] and len(kept) == 2 and kept.tokens == 7
    kept.put(arr(*range(11)), "huge")  # past the bound on its own: not kept
    assert dropped == ["a", "huge"]
    assert KeptStates(0, 100, on_drop=dropped.append).put(arr(1), "none") is None and dropped[-1] == "none"
    # a prompt shorter than a kept state, or one that differs inside it, does not take it
    assert kept.take(arr(5, 6, 7)) is None and kept.take(arr(5, 0, 7, 8, 1)) is None
    assert kept.take(arr(5, 6, 7, 8, 1)) == "b" and kept.tokens == 3
