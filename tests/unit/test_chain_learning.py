"""How the chain learns acceptance: every asked speculator's draft is judged against the emitted tokens,
the estimate is conditioned on the previous verdict, the cost policy prefers a sure short draft, and a sent
draft's verdict calibrates the estimate by position."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import chain as chain_module
from specray.engine.policy.acceptance import AcceptanceTracker, judge, next_state
from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, SeqDraftRequest
from specray.engine.policy.pricing import Pricing, draft_value
from specray.engine.config import ChainConfig
from specray.engine.speculator import DraftRequest, Speculator


class Fixed(Speculator):
    """Drafts a fixed token list (what a test wants it to propose)."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        self.tokens = np.array(tokens, dtype=np.int32)

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        return self.tokens


def policy_of(specs: dict[str, Speculator], policy: str = "cost") -> DraftPolicy:
    """A chain of `specs` and its draft policy (the policy asks the chain, and tells it the verdicts)."""
    return DraftPolicy(Chain(ChainConfig(speculators=list(specs), policy=policy, n_max=16),
                             lambda name, params: specs[name]))


def test_judge_counts_accepted_prefix_and_censoring():
    assert judge(np.array([1, 2, 3]), np.array([1, 2, 9])) == (2, False)
    assert judge(np.array([1, 2, 3]), np.array([1, 2])) == (2, True)  # tokens ran out first
    assert judge(np.array([4]), np.array([5])) == (0, False)
    assert judge(np.array([1, 2]), np.array([1, 2, 3])) == (2, False)  # whole draft accepted


def test_a_draft_that_was_not_sent_still_learns_from_the_emitted_tokens():
    good, bad = Fixed([7, 8, 9]), Fixed([5, 5, 5])
    policy = policy_of({"good": good, "bad": bad})
    for _ in range(30):
        [prop] = policy.propose([SeqDraftRequest(0, ("good", "bad"), np.array([1, 2, 3], np.int32), 3)])
        prop.cut(0)  # the planner sent nothing: the round emits one token
        policy.accept(prop, 0, 0, np.array([7], np.int32))
    # nothing was verified, yet the first token of each is judged: `good` is right, `bad` wrong
    assert policy.estimates.tracker("good").prefix_probs(0, 1)[0] > 0.9
    assert policy.estimates.tracker("bad").prefix_probs(0, 1)[0] < 0.1
    # the speculators' own stats count only what was sent
    assert good.stats.drafts_chosen == 0 and bad.stats.drafts_chosen == 0


def test_the_cost_policy_prefers_a_sure_short_draft_to_a_long_shaky_one():
    price = Pricing(cost=lambda n: 0.010 + 0.006 * (n - 1), base_tokens=1, n_decoding=1)
    sure = np.array([0.97, 0.95])
    shaky = np.array([0.6, 0.45, 0.35, 0.3, 0.25, 0.2])
    assert shaky.sum() > sure.sum()  # by expected accepted tokens alone the long one would win
    assert draft_value(sure, price) > draft_value(shaky, price)
    assert draft_value(np.array([0.3]), price) == 0.0  # not worth its verify time at all


def test_estimate_follows_the_previous_verdict():
    t = AcceptanceTracker()
    for s in range(30):  # spans that copy: after a wholly accepted draft the next one is too
        for n in (8, 8, 8, 0, 0, 0):
            t.update(s, 8, n)
    t.update(1000, 8, 8)
    t.update(1001, 8, 0)
    assert t.prefix_probs(1000, 4)[-1] > 0.5 > 0.1 > t.prefix_probs(1001, 1)[0]
    assert next_state(0) != next_state(8)


def test_censored_verdicts_add_no_failures():
    t = AcceptanceTracker(prior=0.5)
    for _ in range(50):
        t.update(0, 8, 1, censored=True)  # one token matched, then the judgement stopped
    assert t.global_rate() > 0.95
    assert t.pos_trials[1] == 0  # position 1 was never judged


@pytest.mark.parametrize("policy", ["first", "expected", "cost"])
def test_every_policy_records_the_drafts_it_asked_for(policy):
    policy = policy_of({"a": Fixed([3, 4]), "b": Fixed([3, 9])}, policy)
    [prop] = policy.propose([SeqDraftRequest(0, ("a", "b"), np.array([1, 2], np.int32), 4)])
    assert prop.speculator in ("a", "b")
    assert set(prop.drafts) == set(prop.asked)


def test_a_long_draft_that_breaks_its_promise_shrinks_the_next_estimate():
    spec = Fixed(list(range(100, 132)))
    policy = policy_of({"s": spec})
    policy.chain.config.n_max = 32
    history = np.array([1, 2, 3], np.int32)
    for _ in range(12):  # short drafts, always accepted: the tracker extrapolates that to long ones
        [prop] = policy.propose([SeqDraftRequest(0, ("s",), history, 4)])
        policy.accept(prop, len(prop.tokens), len(prop.tokens), np.arange(100, 105, dtype=np.int32))
    [prop] = policy.propose([SeqDraftRequest(0, ("s",), history, 32)])
    assert len(prop.tokens) == 32 and prop.prefix_probs.sum() > 16  # promised: over half of it
    policy.accept(prop, 32, 3, np.array([100, 101, 102, 7], np.int32))  # delivered: 3
    [prop] = policy.propose([SeqDraftRequest(1, ("s",), history, 32)])  # a fresh sequence: no per-seq shift
    raw, calibrated = prop.raw_probs, prop.prefix_probs
    # the tracker alone still expects much of a long draft; the calibration remembers the miss at the
    # positions it happened and leaves the early ones (accepted every time) alone
    assert raw[8:].mean() > 0.3
    assert calibrated[8:].mean() < 0.5 * raw[8:].mean()
    assert calibrated[0] >= 0.95 * raw[0]
    assert np.all(np.diff(calibrated) <= 0) and calibrated.max() < 1
    f = policy.estimates.calibration("s").factors()
    assert f[0] >= 1.0 > 0.5 > f[5]  # position bucket 16-31 shrunk hard, position 0 not


def test_only_sent_drafts_calibrate():
    policy = policy_of({"a": Fixed([3, 4]), "b": Fixed([3, 9])})
    [prop] = policy.propose([SeqDraftRequest(0, ("a", "b"), np.array([1, 2], np.int32), 2)])
    sent = prop.speculator
    policy.accept(prop, 2, 0, np.array([5], np.int32))
    other = "b" if sent == "a" else "a"
    assert policy.estimates.calibration(sent).predicted.sum() > 0 and policy.estimates.calibration(sent).realised.sum() == 0
    assert policy.estimates.calibration(other).predicted.sum() == 0  # judged for the tracker, not scored here


def test_a_speculator_whose_drafts_are_never_worth_sending_is_asked_only_on_probe_rounds():
    # every verify row costs a whole plain decode: no draft is worth its verify time, however right it turns
    # out, so once its first 64 drafts are judged (the gate's learning period: lookup_gate.py) its look-ups
    # buy nothing and the gate asks it only now and then; priced so that drafts pay, the same right drafts
    # keep it asked every round
    def rounds(pricing: Pricing, n: int = 1600) -> tuple[DraftPolicy, int]:
        policy, asked = policy_of({"s": Fixed([7, 8, 9])}), 0
        for _ in range(n):
            [prop] = policy.propose([SeqDraftRequest(0, ("s",), np.array([1, 2, 3], np.int32), 3)], pricing=pricing)
            asked += "s" in prop.asked
            prop.cut(0)  # nothing sent: the round emits one token, the draft's first
            policy.accept(prop, 0, 0, np.array([7], np.int32))
        return policy, asked

    linear, asked = rounds(Pricing(cost=lambda n: 0.010 * n, base_tokens=1, n_decoding=1))
    assert asked < 0.45 * 1600 and linear.gate.skipped["s"] > 800
    assert linear.estimates.tracker("s").prefix_probs(0, 1)[0] > 0.9  # right all along: the tracker knows, the gate too
    cheap, asked = rounds(Pricing(cost=lambda n: 0.010 + 0.0005 * (n - 1), base_tokens=1, n_decoding=1))
    assert asked == 1600 and not cheap.gate.skipped


def test_chain_doctests():
    failed, attempted = doctest.testmod(chain_module)
    assert attempted >= 5 and failed == 0
