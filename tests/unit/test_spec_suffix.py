"""suffix: SuffixDecoding-style per-request + global suffix tries."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from specray.engine.speculators.suffix import (
    SuffixParams,
    SuffixSpeculator,
    SuffixTrie,
    suffix_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle
from .suffix_trie_reference import ObjectSuffixTrie


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
    assert trie.count_of(trie.ROOT) == sum(len(q) for q in seqs)
    # cached best child is a true maximum at every explicit node (once refreshed)
    stack = [trie.ROOT]
    reached = 0
    while stack:
        node = stack.pop()
        reached += 1
        best, bestc = trie.best_of(node)
        items = trie.children(node)
        counts = {t: trie.count_of(c) for t, c in items}
        assert len(counts) == len(items)
        if counts:
            assert bestc == max(counts.values()) and counts[best] == bestc
            assert sum(counts.values()) <= trie.count_of(node)
        else:
            assert bestc == 0
        assert trie.holds_children_inline(node) == (len(items) <= 1)  # one child inline, 2+ in a dict
        stack.extend(c for _, c in items if c < 0)
    assert reached == trie.n_nodes  # every node in use hangs off the root: removals took out whole subtrees


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
    assert trie.count_of(trie.ROOT) == 0 and trie.children(trie.ROOT) == [] and trie.n_tokens == 0
    assert trie.n_nodes == 1  # the root: every other node was taken out


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


def _same_trie(flat: SuffixTrie, ref: ObjectSuffixTrie, rng, sids) -> None:
    """Counts, growing suffixes, walks and runner-ups of the flat trie equal the object-per-node reference's."""
    for _ in range(30):
        s = rng.integers(0, 4, int(rng.integers(1, flat.max_depth + 1))).tolist()
        assert flat.count(s) == ref.count(s), s
    for sid in sids:
        mine, theirs = flat.active_states(sid), ref.active_states(sid)
        assert [k for k, _ in mine] == [k for k, _ in theirs]
        for (k, a), (_, b) in zip(mine, theirs):
            assert flat.count_of(a) == b.count
            for budget, p_min in ((8, 0.0), (4, 0.3)):
                walk = flat.walk(k, a, budget, p_min)
                assert walk == ref.walk(k, b, budget, p_min)
                got = [(x.at, x.tokens.tolist(), x.weight) for x in flat.runner_ups(k, a, walk[0], budget, p_min)]
                want = [(x.at, x.tokens.tolist(), x.weight) for x in ref.runner_ups(k, b, walk[0], budget, p_min)]
                assert got == want
    for _ in range(10):  # a context's states, matched afresh, walk alike
        ctx = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
        a, b = flat.match(ctx), ref.match(ctx)
        assert len(a) == len(b)
        for k in range(len(a)):
            assert flat.walk(k + 1, a[k], 6, 0.1) == ref.walk(k + 1, b[k], 6, 0.1)


@pytest.mark.parametrize("seed", range(4))
def test_flat_trie_equals_the_object_per_node_trie(seed):
    """Operation by operation (sequences grown interleaved, finished, removed whole or in slices as the global
    trie does), the flat trie answers as the trie with an object per node did."""
    rng = np.random.default_rng(100 + seed)
    D = int(rng.integers(3, 9))
    flat, ref = SuffixTrie(D), ObjectSuffixTrie(D)
    live: list[int] = []
    done: list[int] = []
    nid = 0
    for step in range(120):
        r = rng.random()
        if r < 0.55 or not (live or done):
            if not live or rng.random() < 0.25:
                live.append(nid)
                nid += 1
            sid = live[int(rng.integers(0, len(live)))]
            piece = rng.integers(0, 4, int(rng.integers(1, 9))).tolist()
            flat.extend(sid, piece)
            ref.extend(sid, piece)
        elif r < 0.7 and live:
            sid = live.pop(int(rng.integers(0, len(live))))
            flat.finish(sid)
            ref.finish(sid)
            done.append(sid)
        elif done:
            sid = done.pop(int(rng.integers(0, len(done))))
            if sid not in flat.seqs:  # begun but never grown
                continue
            L = len(flat.seqs[sid])
            cut = int(rng.integers(0, L + 1))  # in two slices, as SuffixSpeculator._pump spreads an eviction
            for a, b in ((0, cut), (cut, L)):
                flat.remove_range(sid, a, b)
                ref.remove_range(sid, a, b)
            flat.drop_seq(sid)
            ref.drop_seq(sid)
            flat.bump_version()
        if step % 10 == 9:
            _same_trie(flat, ref, rng, live + done)
    _same_trie(flat, ref, rng, live + done)
    assert sum(len(flat.seqs.get(s, ())) for s in live + done) > 50  # the trie held something to compare


def test_removed_nodes_are_reused_after_a_version_bump():
    """A global trie that keeps evicting its oldest sequence holds about as many node slots as its peak use:
    what a removal takes out is reused once bump_version has run, not before."""
    rng = np.random.default_rng(5)
    trie = SuffixTrie(8)
    peak = 0
    for sid in range(200):
        trie.extend(sid, rng.integers(0, 5, 60).tolist())
        trie.finish(sid)
        peak = max(peak, trie.n_nodes)
        if sid >= 4:
            used = trie.n_nodes
            trie.remove(sid - 4)
            assert trie.n_nodes < used and trie.n_slots >= used  # taken out, not yet reusable
            trie.bump_version()
    assert trie.n_slots <= peak + 60 * 8  # at most one sequence's worth of new nodes beyond the peak in use


def test_a_filled_trie_adds_no_object_per_node_to_the_garbage_collector():
    """A filled global trie holds hundreds of thousands of nodes: they must not be objects Python's cyclic
    collector walks at every full collection."""
    rng = np.random.default_rng(6)
    text = np.tile(rng.integers(0, 50, 400), 12) + rng.integers(0, 2, 4800)  # repeats: many explicit nodes
    gc.collect()
    before = len(gc.get_objects())
    trie = SuffixTrie(32)
    trie.extend(0, text.tolist())
    trie.extend(1, text[::-1].tolist())
    added = len(gc.get_objects()) - before
    assert trie.n_nodes > 5000
    assert added < 50, added


def test_a_state_matched_before_a_removal_walks_as_it_did_until_the_version_moves():
    """The global trie evicts a sequence in slices over several rounds and bumps its version only at the end:
    in between, a request's matching states may name nodes the removal took out. They must walk as the
    object-per-node trie's detached nodes did, not as whatever a new sequence made of their slots."""
    flat, ref = SuffixTrie(8), ObjectSuffixTrie(8)
    for t in (flat, ref):
        t.extend(0, [1, 2, 3, 4, 1, 2, 3, 4])
        t.finish(0)
    stale, stale_ref = flat.match([1, 2, 3]), ref.match([1, 2, 3])
    for t in (flat, ref):
        t.remove_range(0, 0, 8)  # every suffix out: "1" and everything below it taken out
        t.extend(1, [5, 6, 5, 6, 5, 6, 5, 6])  # new nodes, before the version moves
    assert flat.count([1, 2]) == ref.count([1, 2]) == 0
    for k in (2, 3):  # taken out below "1", their counts as the removal left them
        assert flat.walk(k, stale[k - 1], 6, 0.0) == ref.walk(k, stale_ref[k - 1], 6, 0.0)
    assert flat.walk(1, stale[0], 6, 0.0) == ([], [])  # "1" itself: count 0, no walk (the reference divided by 0)
    assert flat.walk(3, stale[2], 6, 0.0)[0] == [4]  # the detached node's best child, as the removal left it
    flat.drop_seq(0)
    flat.bump_version()  # now the slots are reused
    flat.extend(2, [7, 8, 7, 8, 7, 8])
    assert flat.count([7, 8]) == 3 and flat.count([5, 6]) == 4


def test_a_negative_sequence_id_is_refused():
    with pytest.raises(ValueError, match="sequence id"):
        SuffixTrie(8).extend(-1, [1, 2, 3])
