"""Draft trees: their shape, their verification (greedy and sampled, against the target's distribution), the
policy's pricing of branches and the speculators' runner-ups."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specray.engine.draft_tree import Branch, DraftTree
from specray.engine.policy.trees import TreePlanner, accepted_path, branch_probs
from specray.engine.sampling import SamplingParams, target_probs
from specray.engine.verify import verify_greedy
from specray.engine.verify_tree import verify_tree_greedy, verify_tree_sampled

V = 6


def rows_for(tree: DraftTree, want: dict[tuple[int, ...], int]) -> np.ndarray:
    """Logits rows (root, then each node) whose argmax after a path of tokens is want[path] (else token 0)."""
    rows = np.zeros((len(tree) + 1, V), np.float32)
    for r in range(len(tree) + 1):
        path = () if r == 0 else tuple(tree.tokens[tree.path(r - 1)].tolist())
        rows[r, want.get(path, 0)] = 5.0
    return rows


def test_build_drops_branches_it_cannot_place():
    t = DraftTree.build([1, 2], [(0, [1, 5]), (2, [3]), (1, []), (-1, [4]), Branch(1, np.array([4]), 0.5)])
    assert t.tokens.tolist() == [1, 2, 4] and t.parents.tolist() == [-1, 0, 0]
    assert t.leaves == [1, 2] and t.n_branches == 2
    assert DraftTree.linear([7, 8]).is_linear and DraftTree.linear([]).leaves == []


def test_greedy_tree_takes_the_longest_path_of_argmaxes():
    t = DraftTree.build([1, 2, 3], [(0, [4, 5]), (2, [5])])
    want = {(): 1, (1,): 2, (1, 2): 5, (1, 2, 5): 4}
    v = verify_tree_greedy(rows_for(t, want), t)
    assert (t.tokens[v.path].tolist(), v.next_token, v.branch) == ([1, 2, 5], 4, 2)
    # a linear tree is verify_greedy
    lin = DraftTree.linear([1, 2, 3])
    rows = rows_for(lin, want)
    tv = verify_tree_greedy(rows, lin)
    assert (tv.n_accepted, tv.next_token) == tuple(verify_greedy(rows, lin.tokens))


def test_greedy_tree_applies_penalties_along_its_own_path():
    # token 2 is the argmax everywhere, narrowly: a repetition penalty over the path turns it down once seen
    t = DraftTree.build([2, 2], [(0, [3, 2])])
    rows = np.tile(np.array([0, 0, 1.0, 0.9, 0, 0], np.float32), (len(t) + 1, 1))
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    v = verify_tree_greedy(rows, t, np.zeros(0, np.int32), params)
    assert (t.tokens[v.path].tolist(), v.next_token) == ([2], 3)  # after 2, the penalised 2 loses to 3


def test_tree_rows_must_match_the_tree():
    with pytest.raises(ValueError, match="shape"):
        verify_tree_greedy(np.zeros((2, V), np.float32), DraftTree.linear([1, 2]))
    with pytest.raises(ValueError, match="ids"):
        verify_tree_greedy(np.zeros((2, V), np.float32), DraftTree.linear([V]))


P = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])


def _emitted_pairs(tree: DraftTree, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    logits = np.log(np.tile(P, (len(tree) + 1, 1))).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    first, second = np.zeros(V), np.zeros(V)
    ranks: dict[int, int] = {}
    for t in range(n):
        rngs = [np.random.default_rng((seed, t, d)) for d in range(int(tree.depths.max()) + 2)]
        v = verify_tree_sampled(logits, tree, params, rngs)
        toks = tree.tokens[v.path].tolist() + [v.next_token]
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
        ranks[v.branch] = ranks.get(v.branch, 0) + 1
    return first, second, ranks


def test_sampled_tree_emits_the_target_distribution():
    n = 20000
    tree = DraftTree.build([3, 1], [(0, [0, 2]), (0, [5]), (1, [0])])  # runner-ups likely and unlikely
    first, second, ranks = _emitted_pairs(tree, n, seed=7)
    assert chisquare(first, P * n).pvalue > 0.001
    # given the first token, the second follows the target too (every row here has the same distribution)
    assert chisquare(second, P * second.sum()).pvalue > 0.001
    assert set(ranks) == {0, 1, 2, 3}  # every branch was taken some time
    # a first-level node is accepted with the target's probability of its token
    assert abs(ranks[1] / n - (P[0] * 1.0)) < 0.02  # 0 then anything: branch 1 holds every path through 0


def test_the_sampled_test_has_power_against_a_biased_walk():
    """A walk that prefers the main draft's child whenever it is a candidate (as a verifier that tries the
    main draft first with the wrong acceptance rule would) fails the same check."""
    n = 20000
    tree = DraftTree.build([3], [(0, [0])])
    logits = np.log(np.tile(P, (len(tree) + 1, 1))).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    first = np.zeros(V)
    rng = np.random.default_rng(3)
    for _ in range(n):
        p = target_probs(logits[0], params)
        x = 3 if rng.random() < 2 * p[3] else int(rng.choice(V, p=p))  # accepts the draft twice as often
        first[x] += 1
    assert chisquare(first, P * n).pvalue < 1e-6


def test_sampled_tree_is_coupled_to_the_position():
    """A seeded draw at a position is the same with or without a tree around it."""
    logits = np.log(np.tile(P, (4, 1))).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    tree = DraftTree.build([1, 2], [(0, [0])])
    for t in range(200):
        rngs = lambda: [np.random.default_rng((t, d)) for d in range(3)]  # noqa: E731
        v = verify_tree_sampled(logits, tree, params, rngs())
        alone = verify_tree_sampled(logits[:1], DraftTree.linear([]), params, rngs())
        assert (tree.tokens[v.path].tolist() + [v.next_token])[0] == alone.next_token


def test_branch_probabilities_stay_below_what_the_main_token_leaves():
    main = np.array([0.9, 0.8])
    p = branch_probs(main, Branch(0, np.array([4, 5, 6]), 1.0), 4.0)
    assert p[0] == pytest.approx(0.1)  # min(1 - 0.9, 0.9 x 1 x 4)
    assert p[1] == pytest.approx(0.1 * 0.8 / 0.9) and p[2] == pytest.approx(p[1] * 0.8 / 0.9)
    assert branch_probs(main, Branch(2, np.array([4]), 1.0), 1.0).tolist() == [0.0]  # past the main draft


class _Spec:
    offers_branches = True

    def __init__(self, branches):
        self._b = branches

    def branches(self, seq_id, main, width):
        return self._b[:width]


class _Prop:
    def __init__(self, tokens, probs):
        self.seq_id, self.speculator, self.tree = 0, "s", None
        self.tokens, self.prefix_probs = np.array(tokens, np.int32), np.array(probs)


class _Req:
    tree = True


def test_planner_attaches_kept_branches_and_learns_from_verdicts():
    planner = TreePlanner()
    prop = _Prop([1, 2], [0.5, 0.4])
    b = [Branch(0, np.array([7, 8]), 0.8), Branch(1, np.array([2, 9]), 0.5), Branch(0, np.array([1]), 1.0)]
    cands = planner.candidates([prop], [_Req()], lambda name: _Spec(b), width=3, pool=8)
    assert [c[1].at for c in cands] == [0, 0, 1]
    planner.attach([prop], cands, [1, 2, 1], pool=8, limits=[8])  # cands: [1] (dropped below), [7 8], [2 9]
    # the branch repeating the main token (1 at depth 0) and the one repeating its own (2 at depth 1) are dropped
    assert prop.tree.tokens.tolist() == [1, 2, 7, 8] and prop.tree.n_branches == 2
    planner.round_sent([prop])
    planner.judge(prop, np.array([7, 8, 3]))
    snap = planner.snapshot()
    assert snap["by_speculator"]["s"]["accepted_by_rank"] == [0, 1]
    assert snap["by_speculator"]["s"]["accepted_tokens"] == 2 and snap["tree_rounds"] == 1
    assert snap["branch_factor"]["s"] > 1.0  # taken where about 0.4 was predicted


def test_accepted_path_reads_the_emitted_tokens():
    t = DraftTree.build([5, 6, 7], [(1, [8, 9])])
    assert accepted_path(t, [5, 8, 9, 1]) == ([0, 3, 4], 1)
    assert accepted_path(t, [5, 6, 7, 1]) == ([0, 1, 2], 0)


@pytest.mark.parametrize("argv, message", [
    (["--tree-branches", "16"], "--tree-branches must be 0 to 15, got 16"),
    (["--tree-branches", "x"], "--tree-branches: invalid int value"),
])
def test_serve_names_a_bad_tree_flag(argv, message, capsys):
    from specray.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
    assert message in capsys.readouterr().err


def test_tree_flags_reach_the_engine_config():
    from specray.cli import main as cli
    from specray.cli.serve import flag_overrides

    over = flag_overrides(cli.build_parser().parse_args(["serve", "--tree-branches", "2", "--spec-trees"]))
    assert over["engine"]["tree_branches"] == 2 and over["engine"]["chain"]["trees"] is True


def test_the_target_gets_branch_ids_only_where_trees_can_be_verified():
    from specray.deployments.builder import tree_seqs
    from specray.engine.config import ChainConfig, EngineConfig

    on = ChainConfig(trees=True)
    assert tree_seqs(EngineConfig(slots=4, tree_branches=2, chain=on), "attention") == 8
    assert tree_seqs(EngineConfig(slots=4, tree_branches=2), "attention") == 0  # the chain sends none
    assert tree_seqs(EngineConfig(slots=4, chain=ChainConfig(policy="first", trees=True)), "attention") == 0
    assert tree_seqs(EngineConfig(slots=4, verify_shape="bucketed", chain=on), "attention") == 0
    assert tree_seqs(EngineConfig(slots=4, chain=on), "recurrent") == 0


@pytest.mark.parametrize("name, params", [
    ("suffix", {"min_match": 2, "p_min": 0.01}),
    ("ngram_cache", {}),
    ("ngram_map_k4v", {"size_n": 1, "size_m": 2}),
])
def test_speculators_give_runner_ups_beside_their_last_draft_only(name, params):
    from specray.engine.speculator import DraftRequest
    from specray.engine.speculators.registry import speculator_factory

    spec = speculator_factory()(name, params)
    # after "7 1" the history went on with 2 three times and with 3 once (k4v: 4 x [1 2], [3 4], [1 5])
    h = np.array([7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7, 1, 5, 7, 1], np.int32)
    if name == "ngram_map_k4v":
        h = h[:-1]
    spec.begin(0, h)
    [d] = spec.draft([DraftRequest(0, h, 4)])
    assert len(d) and spec.offers_branches
    branches = spec.branches(0, d, 3)
    assert branches, f"{name} drafted {d.tolist()} and held no runner-up"
    for b in branches:
        assert 0 <= b.at < len(d) and 0 < b.weight <= 1.0
        assert int(b.tokens[0]) != int(d[b.at])  # it leaves the main draft where it starts
    spec.draft([DraftRequest(0, h, 4)])
    assert spec.branches(0, np.array([int(d[0]) + 1], np.int32), 3) == []  # not its last draft


def test_a_tree_stays_within_the_draft_rows_its_sequence_may_send():
    planner = TreePlanner()
    prop = _Prop([1, 2], [0.5, 0.4])
    b = [Branch(0, np.array([7, 8, 9]), 0.8), Branch(1, np.array([5]), 0.5)]
    cands = planner.candidates([prop], [_Req()], lambda name: _Spec(b), width=3, pool=8)
    planner.attach([prop], cands, [3, 1], pool=8, limits=[4])  # 2 main nodes + 2 of the first branch
    assert prop.tree.tokens.tolist() == [1, 2, 7, 8]
    prop = _Prop([1, 2], [0.5, 0.4])
    planner.attach([prop], cands, [3, 1], pool=1, limits=[8])  # one spare sequence id: one branch
    assert prop.tree.n_branches == 2


def test_the_policy_sends_a_tree_where_rows_are_nearly_free_and_none_where_they_are_dear():
    from specray.engine.chain import Chain
    from specray.engine.config import ChainConfig
    from specray.engine.cost import DecodeCostModel
    from specray.engine.policy import DraftPolicy, Room, SeqDraftRequest
    from specray.engine.speculators.registry import speculator_factory

    h = np.array([7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7, 1, 5, 7, 1], np.int32)
    sent = {}
    for label, table in (("cheap", {1: 0.010, 64: 0.0101}), ("dear", {1: 0.010, 2: 0.020, 64: 0.640})):
        chain = Chain(ChainConfig(speculators=["suffix"], params={"suffix": {"min_match": 2, "p_min": 0.01}},
                                  trees=True), speculator_factory())
        policy = DraftPolicy(chain, DecodeCostModel(table, learn=False))
        chain.begin(0, ("suffix",), h)
        room = Room(free_rows=64, base_rows=1, tree_width=3, tree_seqs=3)
        [p] = policy.plan_round([SeqDraftRequest(0, ("suffix",), h, 4, tree=True)], room)
        sent[label] = p
    assert sent["cheap"].tree is not None and sent["cheap"].rows > len(sent["cheap"].tokens)
    assert sent["dear"].tree is None



def test_a_tree_verdict_is_judged_when_the_speculators_are_told_not_when_the_policy_learns():
    """Overlapped rounds learn a verdict a round late (DraftPolicy.learn), after the next round's tree was sent:
    a tree is judged in DraftPolicy.tell, against what was sent with it."""
    from specray.engine.chain import Chain
    from specray.engine.config import ChainConfig
    from specray.engine.cost import DecodeCostModel
    from specray.engine.policy import DraftPolicy, Room, SeqDraftRequest
    from specray.engine.speculators.registry import speculator_factory

    h = np.array([7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7, 1, 5, 7, 1], np.int32)
    chain = Chain(ChainConfig(speculators=["suffix"], params={"suffix": {"min_match": 2, "p_min": 0.01}},
                              trees=True), speculator_factory())
    policy = DraftPolicy(chain, DecodeCostModel({1: 0.010, 64: 0.0101}, learn=False))
    chain.begin(0, ("suffix",), h)
    room = Room(free_rows=64, base_rows=1, tree_width=3, tree_seqs=3)
    [p] = policy.plan_round([SeqDraftRequest(0, ("suffix",), h, 4, tree=True)], room)
    assert p.tree is not None
    emitted = np.array([9], np.int32)  # the target took none of it
    policy.tell(p, len(p.tokens), 0, emitted)
    judged = policy.trees.snapshot()["by_speculator"]["suffix"]
    assert judged["drafts"] == 1 and judged["accepted_by_rank"] == [1]
    # the next round sends a tree for the sequence again (the same history: any round that sends one), and only
    # then does the policy learn from the first verdict
    [p2] = policy.plan_round([SeqDraftRequest(0, ("suffix",), h, 4, tree=True)], room)
    assert p2.tree is not None
    policy.learn(p, len(p.tokens), 0, emitted)
    assert policy.trees.snapshot()["by_speculator"]["suffix"] == judged  # judged once, in tell
    policy.tell(p2, len(p2.tokens), 0, emitted)
    assert policy.trees.snapshot()["by_speculator"]["suffix"]["drafts"] == 2

def test_an_ab_arm_turns_trees_on_for_its_own_engine():
    from specray.deployments.ab.arms import ArmConfig
    from specray.deployments.builder import tree_seqs
    from specray.engine.config import ChainConfig, EngineConfig

    base = ChainConfig()
    arm = ArmConfig(name="trees", trees=True).chain_config(base)
    assert arm.trees and not ArmConfig(name="linear").chain_config(base).trees
    assert tree_seqs(EngineConfig(slots=4, chain=arm), "attention") == 12


def test_doctests():
    import doctest

    from specray.engine import draft_tree
    from specray.native import slot_backend

    for module in (draft_tree, slot_backend):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__
