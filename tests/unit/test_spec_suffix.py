"""suffix: SuffixDecoding-style per-request + global suffix tries."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculators.suffix import (
    SuffixParams,
    SuffixSpeculator,
    SuffixTrie,
    _Node,
    suffix_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle


def brute_count(seqs, s):
    k = len(s)
    return sum(1 for q in seqs for i in range(len(q) - k + 1) if q[i : i + k] == s)


def check_trie(trie: SuffixTrie, seqs: list[list[int]], rng, n_probe=300):
    D = trie.max_depth
    subs = {tuple(q[i : i + k]) for q in seqs for k in range(1, D + 1) for i in range(len(q) - k + 1)}
    for s in subs:
        assert trie.count(list(s)) == brute_count(seqs, list(s)), s
    for _ in range(n_probe):  # absent strings
        s = rng.integers(0, 4, int(rng.integers(1, D + 1))).tolist()
        assert trie.count(s) == brute_count(seqs, s)
    assert trie.root.count == sum(len(q) for q in seqs)
    # cached best child is a true maximum at every explicit node (once refreshed)
    stack = [trie.root]
    while stack:
        node = stack.pop().fresh()
        items = node.items()
        counts = {t: (c.count if type(c) is _Node else 1) for t, c in items}
        assert len(counts) == len(items)
        if counts:
            assert node.bestc == max(counts.values()) and counts[node.best] == node.bestc
            assert sum(counts.values()) <= node.count
        else:
            assert node.bestc == 0
        assert (node.kids is None) == (len(items) <= 1)  # one child inline, 2+ in a dict
        stack.extend(c for _, c in items if type(c) is _Node)


@pytest.mark.parametrize("seed", range(3))
def test_trie_counts_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    trie = SuffixTrie(max_depth=6)
    seqs = {}
    for sid in range(3):
        seqs[sid] = []
        for _ in range(5):  # grown in pieces, interleaved with the others
            piece = rng.integers(0, 3, int(rng.integers(1, 12))).tolist()
            trie.extend(sid, piece)
            seqs[sid] += piece
    check_trie(trie, list(seqs.values()), rng)
    trie.remove(1)
    check_trie(trie, [seqs[0], seqs[2]], rng)
    trie.extend(5, [0, 1, 2, 0, 1, 2, 0, 0])
    check_trie(trie, [seqs[0], seqs[2], [0, 1, 2, 0, 1, 2, 0, 0]], rng)
    trie.remove(0)
    trie.remove(2)
    trie.remove(5)
    assert trie.root.count == 0 and trie.root.items() == [] and trie.n_tokens == 0


def test_random_interleaved_extend_finish_remove():
    rng = np.random.default_rng(11)
    for _ in range(150):
        D = int(rng.integers(2, 6))
        trie = SuffixTrie(D)
        seqs: dict[int, list[int]] = {}
        live: list[int] = []
        finished: list[int] = []
        nid = 0
        for _ in range(int(rng.integers(1, 10))):
            r = rng.random()
            if r < 0.6 or not seqs:
                if not live or rng.random() < 0.3:
                    live.append(nid)
                    seqs[nid] = []
                    nid += 1
                sid = live[int(rng.integers(0, len(live)))]
                piece = rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
                trie.extend(sid, piece)  # sequences grow interleaved
                seqs[sid] += piece
            elif r < 0.8 and live:
                sid = live.pop(int(rng.integers(0, len(live))))
                trie.finish(sid)
                finished.append(sid)
            elif finished:
                sid = finished.pop(int(rng.integers(0, len(finished))))
                trie.remove(sid)
                del seqs[sid]
        check_trie(trie, list(seqs.values()), rng, n_probe=20)


def test_repeated_token_run_and_depth_bound():
    trie = SuffixTrie(max_depth=4)
    trie.extend(0, [7] * 10)
    assert [trie.count([7] * k) for k in range(1, 5)] == [10, 9, 8, 7]
    assert [k for k, _ in trie.active_states(0)] == [1, 2, 3]  # depth 4 cannot grow


def test_draft_probability_counts_trailing_occurrence():
    trie = SuffixTrie(max_depth=16)
    trie.extend(0, [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    c = [(trie, "request", k, s) for k, s in trie.active_states(0)]
    d = suffix_draft(c, n_max=8, min_match=2, p_min=0.1)
    assert (d.tokens, d.probs, d.match_len) == ([4, 5, 6], [0.5, 0.5, 0.5], 3)  # 3 = k x factor 1
    d = suffix_draft(c, n_max=8, min_match=2, p_min=0.1, max_spec_factor=10)
    assert d.tokens == [4, 5, 6, 7, 8, 1, 2, 3]  # the leaf chain runs to the sequence end
    assert suffix_draft(c, n_max=8, min_match=4, p_min=0.1) is None  # match 3 < min_match
    assert suffix_draft(c, n_max=2, min_match=2, p_min=0.1).tokens == [4, 5]


def test_p_min_cuts_the_path():
    # after "1 2": 3 x3, 4 x1, end x1 -> p(3) = 3/5; after "1 2 3": 5 x2, 6 x1 -> p = 3/5 * 2/3
    trie = SuffixTrie(max_depth=16)
    trie.extend(0, [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 0, 1, 2])
    c = [(trie, "request", k, s) for k, s in trie.active_states(0)]
    d = suffix_draft(c, n_max=4, min_match=2, p_min=0.1, max_spec_factor=2)
    assert d.tokens[:2] == [3, 5] and d.probs[:2] == pytest.approx([0.6, 0.4])
    d = suffix_draft(c, n_max=4, min_match=2, p_min=0.5, max_spec_factor=2)
    assert d.tokens == [3] and d.probs == pytest.approx([0.6])
    assert suffix_draft(c, n_max=4, min_match=2, p_min=0.7, max_spec_factor=2) is None


def test_best_score_picks_between_match_lengths():
    # "2 3" -> 4 x2, 9 x1, end x1 (p 1/2, at most 2 tokens for k=2: score 1.0);
    # "8 2 3" / "0 8 2 3" -> 9 once + end (p 1/2, 3 tokens: score 1.5): the longer wins,
    # and of two match lengths with the same occurrences the longer one is reported
    trie = SuffixTrie(max_depth=16)
    trie.extend(0, [2, 3, 4, 0, 2, 3, 4, 0, 8, 2, 3, 9, 0, 8, 2, 3])
    c = [(trie, "request", k, s) for k, s in trie.active_states(0)]
    d = suffix_draft(c, n_max=3, min_match=2, p_min=0.1, max_spec_factor=1)
    assert d.tokens == [9, 0, 8] and d.match_len == 4 and d.score == pytest.approx(1.5)
    d = suffix_draft(c, n_max=3, min_match=2, p_min=0.1, max_spec_factor=1, max_spec_offset=-2)
    assert d.tokens == [9, 0] and d.match_len == 4  # k=2 now gets 0 tokens


def spec(**kw):
    base = dict(min_match=3, max_depth=16, p_min=0.1, max_spec_factor=4.0)
    base.update(kw)
    return SuffixSpeculator(SuffixParams(**base))


def test_speculator_confidence_empty_and_short():
    sp = spec()
    assert len(draft1(sp, 0, arr(1))) == 0
    assert sp.last_confidence[0].shape == (0,)
    h = arr(5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3)
    d = draft1(sp, 0, h, n_max=4)
    assert d.tolist() == [4, 5, 6, 7]
    assert sp.last_confidence[0] == pytest.approx([0.5] * 4)
    assert sp.last_source[0] == "request"
    assert draft1(sp, 0, h, n_max=2).tolist() == [4, 5]


def test_global_tree_shares_finished_requests():
    sp = spec()
    pattern = [40, 41, 42, 43, 44, 45, 46, 47]
    sp.begin(0, arr(1, 2, 3))
    draft1(sp, 0, arr(1, 2, 3, *pattern))  # generated: the pattern
    sp.begin(1, arr(9, 9, 9))
    assert len(draft1(sp, 1, arr(9, 9, 9, 40, 41, 42))) == 0  # seq 0 not finished: isolated
    sp.end(0)
    assert sp.global_trie.count(pattern) == 0  # queued: inserted by the next draft() call
    assert sp.global_trie.count([1, 2, 3]) == 0  # prompts are not added by default
    d = draft1(sp, 1, arr(9, 9, 9, 40, 41, 42, 43), n_max=16)
    assert sp.global_trie.count(pattern) == 1
    assert d.tolist() == [44, 45, 46, 47]
    assert sp.last_source[1] == "global"
    assert sp.last_confidence[1] == pytest.approx([1.0] * 4)  # single occurrence, no trailing copy
    # a brand-new sequence (no begin) sees it too
    assert draft1(sp, 2, arr(43, 44, 45), n_max=2).tolist() == [46, 47]


def test_global_tree_is_bounded():
    sp = spec(global_max_seqs=2)
    for i in range(3):
        sp.begin(i, arr(0))
        draft1(sp, i, arr(0, 100 + i, 101 + i, 102 + i, 103 + i))
        sp.end(i)
    sp.flush_global()
    g = sp.global_trie
    assert len(g.seqs) == 2 and g.count([100, 101]) == 0 and g.count([102, 103]) == 2
    sp2 = spec(global_max_tokens=6)
    for i in range(3):  # no begin: the prompt is the first history minus its last token
        draft1(sp2, i, arr(200 + i, 300 + i))
        draft1(sp2, i, arr(200 + i, 300 + i, 301 + i, 302 + i))
        sp2.end(i)  # adds [300+i, 301+i, 302+i]
    sp2.flush_global()
    g2 = sp2.global_trie
    assert g2.n_tokens == 6 and g2.count([200]) == 0
    assert g2.count([300]) == 0 and g2.count([302, 303]) == 2 and g2.count([301, 302]) == 1
    sp3 = spec(global_max_seqs=0)
    draft1(sp3, 0, arr(1, 2, 3))
    sp3.end(0)
    assert sp3.global_trie.n_tokens == 0


def test_global_work_is_spread_over_draft_calls():
    sp = spec(global_work_per_call=4, global_max_seqs=1)
    first = list(range(500, 510))
    sp.add_global(first)
    req = arr(1, 2, 3)
    draft1(sp, 0, req)  # 4 of 10 tokens inserted
    assert sp.global_trie.n_tokens == 4 and sp._global_order == {}
    draft1(sp, 0, req)
    draft1(sp, 0, req)  # 10/10: complete and visible
    assert sp.global_trie.n_tokens == 10 and list(sp._global_order) == [0]
    assert draft1(sp, 1, arr(500, 501, 502, 503), n_max=3).tolist() == [504, 505, 506]
    sp.add_global(list(range(600, 606)))  # the second one evicts the first (max 1 seq)
    for _ in range(4):
        draft1(sp, 0, req)
    assert sp.global_trie.count([500, 501]) == 0 and sp.global_trie.count([600, 601]) == 1
    assert sp.global_trie.n_tokens == 6 and not sp._jobs


def test_per_request_rebuild_and_isolation():
    sp = spec()
    h0 = arr(1, 2, 3, 4, 5, 1, 2, 3)
    assert draft1(sp, 0, h0).tolist() == [4, 5, 1, 2, 3]
    assert len(draft1(sp, 1, arr(7, 1, 2, 3))) == 0  # seq 1 has no copy of seq 0
    assert len(draft1(sp, 0, arr(6, 1, 2, 3))) == 0  # seq 0 reused: rebuilt
    assert sp._seqs[0].trie.count([4, 5]) == 0


def test_state_roundtrip_and_global_rematch():
    sp = spec()
    sp.add_global([50, 51, 52, 53, 54])
    sp2 = spec()
    assert len(draft1(sp2, 0, arr(50, 51, 52))) == 0
    sp2.set_state(sp.get_state())
    assert draft1(sp2, 0, arr(50, 51, 52, 50, 51, 52)).tolist() == [53, 54]  # rematched


def test_params():
    p = SuffixParams()
    assert (p.min_match, p.max_depth, p.p_min) == (5, 64, 0.1)
    with pytest.raises(ValueError):
        SuffixParams(p_min=1.5)
    with pytest.raises(ValueError):
        SuffixParams(max_depth=1)


def test_lifecycle_and_stats():
    rng = np.random.default_rng(7)
    block = rng.integers(100, 200, 40).tolist()
    prompt = rng.integers(0, 50, 20).tolist() + block + [7]
    sp = SuffixSpeculator(SuffixParams(min_match=3))
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=8)
    assert mine["tok_acc"] > 20
    check_stats(sp, mine)
    assert sp._seqs == {} and sp.last_confidence == {}
    assert sp.global_trie.n_tokens == 0 and len(sp._jobs) == 1  # queued at end ...
    sp.flush_global()
    assert sp.global_trie.n_tokens == len(block) + 3 - 1  # ... generated tokens seen by drafts
