"""The cost policy prices model drafts before making them (pure logic, no model)."""

from __future__ import annotations

import time

import numpy as np

from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, SeqDraftRequest
from specray.engine.policy.pricing import Pricing
from specray.engine.config import ChainConfig
from specray.engine.speculator import DraftRequest, Speculator
from specray.engine.speculators.draft_base import ModelSpeculator


class Free(Speculator):
    name = "free"

    def __init__(self, tokens):
        super().__init__()
        self.tokens = np.array(tokens, dtype=np.int32)

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        return self.tokens


class PricedModel(ModelSpeculator):
    """Drafts [7, 7, 7, ...] up to n_max; each draft costs `seconds` per step."""

    name = "model"

    def __init__(self, seconds: float, steps: int = 3, catchup: float = 0.0, takes: float = 0.0):
        super().__init__()
        self.seconds = seconds
        self.takes = takes  # wall time a draft call really takes (may differ from the price)
        self.max_steps = steps
        self.catchup = catchup
        self.asked: list[DraftRequest] = []

    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return self.seconds * n_steps

    def catchup_seconds(self, seq_id: int, history) -> float:
        return self.catchup

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        self.asked.append(req)
        time.sleep(self.takes)
        return np.full(req.n_max, 7, dtype=np.int32)


def cost(n: int) -> float:  # 10 ms + 2 ms per extra row
    return 0.010 + 0.002 * (n - 1)


def make(free_tokens, model_seconds, order=("model", "free"), policy="cost", catchup=0.0):
    specs = {"free": Free(free_tokens), "model": PricedModel(model_seconds, catchup=catchup)}
    chain = Chain(ChainConfig(speculators=list(order), policy=policy), lambda name, p: specs[name])
    return DraftPolicy(chain), specs


def reqs(n=1, chain=("model", "free")):
    return [SeqDraftRequest(i, chain, np.arange(10, dtype=np.int32), 8) for i in range(n)]


def pricing(n=1, explore=0.0, cost=cost):
    return Pricing(cost, base_tokens=n, n_decoding=n, explore=explore)


def test_free_draft_wins_at_equal_expected_acceptance_even_if_listed_after_the_model():
    ch, specs = make([5, 6, 7], model_seconds=0.0001)
    (p,) = ch.propose(reqs(), pricing=pricing())
    assert p.speculator == "free" and p.tokens.tolist() == [5, 6, 7]
    assert specs["model"].asked == [] and p.asked == ("free",)  # the model never ran


def test_cheap_model_drafts_where_the_free_one_has_nothing_and_gets_the_planned_length():
    ch, specs = make([], model_seconds=0.0005)
    props = ch.propose(reqs(3), pricing=pricing(3))
    assert all(p.speculator == "model" for p in props)
    # at 2 ms per verify row only the first draft token pays (0.6 x ...): one draft step, not three
    assert [r.n_max for r in specs["model"].asked] == [1, 1, 1]
    ch, specs = make([], model_seconds=0.0005)
    ch.propose(reqs(3), pricing=pricing(3, cost=lambda n: 0.010 + 0.0002 * (n - 1)))
    assert [r.n_max for r in specs["model"].asked] == [3, 3, 3]  # cheap rows: the model's max_steps (< 8)


def test_a_model_draft_that_does_not_pay_for_its_time_is_not_made():
    # 1 token gained at most ~1.2 per 10 ms round; 3 steps x 20 ms of drafting can never pay
    ch, specs = make([], model_seconds=0.020)
    (p,) = ch.propose(reqs(), pricing=pricing())
    assert p.speculator is None and specs["model"].asked == []
    # explore: with the rounds' savings (here all of each 10 ms round) a 1-token model draft is made anyway,
    # once they cover its price (20 ms draft step + 2 ms verify row), so its acceptance keeps being measured
    made = []
    for _ in range(3):
        (p,) = ch.propose(reqs(), pricing=pricing(explore=1.0))
        made.append(p.speculator)
    assert made == [None, None, "model"] and [r.n_max for r in specs["model"].asked] == [1]


def test_the_model_beats_a_shorter_free_draft_when_it_expects_more():
    ch, specs = make([5], model_seconds=0.0001)
    (p,) = ch.propose(reqs(), pricing=pricing())
    # 0.6 + 0.36 expected from two model tokens (the third does not pay for its row) > 0.6 from one free token
    assert p.speculator == "model" and len(p.tokens) == 2 and p.asked == ("free", "model")
    # planned down to one token it would only tie with the free draft: not worth its time
    ch, specs = make([5], model_seconds=0.0001)
    (p,) = ch.propose(reqs(), pricing=pricing(cost=lambda n: 0.010 + 0.006 * (n - 1)))
    assert p.speculator == "free" and specs["model"].asked == []


def test_a_lagging_draft_cache_is_priced_over_the_rounds_left():
    cheap_rows = dict(cost=lambda n: 0.010 + 0.0002 * (n - 1))
    # steady drafting pays (see above), but this sequence's draft cache must first catch up 0.3 s
    ch, specs = make([], model_seconds=0.001, catchup=0.3)
    few_left = [SeqDraftRequest(0, ("model",), np.arange(10, dtype=np.int32), 8, tokens_left=10)]
    (p,) = ch.propose(few_left, pricing=pricing(**cheap_rows))
    assert p.speculator is None and specs["model"].asked == []  # 10 tokens left: the catch-up never pays off
    many_left = [SeqDraftRequest(0, ("model",), np.arange(10, dtype=np.int32), 8, tokens_left=4000)]
    (p,) = ch.propose(many_left, pricing=pricing(**cheap_rows))
    assert p.speculator == "model"  # paid once, spread over ~1800 rounds


def test_exploring_spends_at_most_its_share_of_the_round_time():
    # a model that never pays, whose draft cache lags (priced 0.05 s of catch-up), and whose drafts really take
    # 0.15 s: exploring at 3% of 10 ms rounds is charged what the drafts took, so it stays within the share
    ch, specs = make([], model_seconds=0.020, catchup=0.05)
    specs["model"].takes = 0.15
    rounds = 2000
    for _ in range(rounds):
        (p,) = ch.propose(reqs(), pricing=pricing(explore=0.03))
        if p.speculator is not None:
            ch.accept(p, 1, 1, np.array([7, 3], dtype=np.int32))
    made = len(specs["model"].asked)
    assert made and all(r.n_max == 1 for r in specs["model"].asked)
    spent = made * (0.15 + 0.002)  # what the drafts took, and their verify rows
    assert spent <= 0.03 * 0.010 * rounds + 0.15  # the share (the last draft may overdraw by its own time)
    assert made >= 3  # and the savings are used, not lost (0.6 s saved: 3-4 such drafts)
    assert ch.models.explore_budget["model"] < 0.072  # what is left would not pay for another exploring draft


def test_learnt_acceptance_decides():
    cheap_rows = pricing(cost=lambda n: 0.010 + 0.0002 * (n - 1))
    ch, specs = make([], model_seconds=0.001)
    (p,) = ch.propose(reqs(), pricing=cheap_rows)
    assert p.speculator == "model"
    for _ in range(40):  # the model's drafts keep failing
        ch.accept(p, 3, 0)
    (p,) = ch.propose(reqs(), pricing=cheap_rows)
    assert p.speculator is None and len(specs["model"].asked) == 1


def test_without_pricing_or_other_policies_the_model_is_asked_as_before():
    ch, specs = make([], model_seconds=10.0)
    (p,) = ch.propose(reqs())
    assert p.speculator == "model"
    ch, specs = make([], model_seconds=10.0, policy="first")
    (p,) = ch.propose(reqs(), pricing=pricing())
    assert p.speculator == "model" and specs["model"].asked[0].n_max == 8


def test_process_reaches_every_named_speculator():
    seen = []

    class Mirror(Free):
        def process(self, seq_id, tokens, pos):
            seen.append((self.name, seq_id, tokens.tolist(), pos))

    a, b = Mirror([]), Mirror([])
    a.name, b.name = "a", "b"
    ch = Chain(ChainConfig(speculators=["a", "b"]), lambda name, p: {"a": a, "b": b}[name])
    ch.process(3, ("b",), np.array([1, 2], dtype=np.int32), 5)
    assert seen == [("b", 3, [1, 2], 5)]
