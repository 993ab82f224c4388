"""Online tuning of the speculators' look-up parameters (engine/policy/tuning.py): the bandit, its bounds, the grid
checks, the per-setting look-ups, and a chain that finds a better setting than its bad start."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.chain import Chain
from specray.engine.policy import DraftPolicy, SeqDraftRequest
from specray.engine.policy.pricing import Pricing
from specray.engine.config import ChainConfig
from specray.engine.speculators.registry import speculator_factory
from specray.engine.policy.tuning import MIN_ROUNDS, SHADOW_ALLOWANCE, Bandit, ParamTuner, tuned_look_up
from specray.engine.speculator import SpeculatorStats
from specray.engine.policy.tuning_shadow import Shadow, ShadowLedger


def test_the_bandit_settles_on_the_best_setting_from_side_by_side_judgments():
    rng = np.random.default_rng(0)
    means = np.array([0.1, 0.8, 0.3, -0.2])  # tokens gained a round by setting; 0 is the configured one
    b = Bandit([{}] * 4)
    picks = []
    for _ in range(300):
        picks.append(b.choose())
        # one shadow: every setting on the same history; what the history offers is shared (the big noise)
        b.record(list(means + rng.normal(0, 2.0) + rng.normal(0, 0.3, 4)))
    assert b.best() == 1
    assert picks[:int(MIN_ROUNDS)] == [0] * int(MIN_ROUNDS)  # the configured setting until others are known
    assert picks[-250:].count(1) == 250, picks[-250:]
    assert b.counts[1] >= 250 and b.judged == 300


def test_a_setting_that_stops_paying_is_left_for_one_that_pays_now():
    """Gains drift. Setting 1 wins for 1000 judgments, then loses to setting 2: discounted records leave it
    within about 100 judgments (undiscounted ones would hold the early verdict for about 1000)."""
    rng = np.random.default_rng(1)
    b = Bandit([{}] * 3)
    picks = []
    for t in range(2000):
        means = np.array([0.2, 0.9 if t < 1000 else -0.3, -0.3 if t < 1000 else 0.6])
        picks.append(b.choose())
        b.record(list(means + rng.normal(0, 0.5, 3)))
    assert picks[900:1000].count(1) == 100  # it had settled on setting 1
    assert picks[1150:1250].count(2) == 100, picks[1000:1150]  # within 150 judgments of the change
    assert picks[-500:].count(2) == 500 and b.best() == 2, b.to_dict({})


def test_the_configured_setting_holds_until_another_has_shown_better():
    b = Bandit([{}] * 3)
    assert {b.choose() for _ in range(20)} == {0}
    for _ in range(int(MIN_ROUNDS)):  # 7 judgments: short of the 7.5 needed
        b.record([0.0, 0.0, 5.0])
    assert b.best() == 0  # not enough judgments to trust setting 2 yet
    b.record([0.0, 0.0, 5.0])
    assert b.best() == 2


def test_shadows_are_made_one_a_round_within_the_allowance_then_within_the_time_share():
    tuner = ParamTuner({"x": {"k": 1}}, {"x": [{"k": 2}]}, explore=0.02)
    reqs = [SeqDraftRequest(s, ("x",), np.zeros(4, np.int32), 8) for s in range(4)]
    made = []
    for rnd in range(SHADOW_ALLOWANCE + 40):
        j = tuner.to_shadow("x", reqs, plain_seconds=0.010)  # 0.2 ms of shadow time saved a round
        if j is not None:
            made.append((rnd, reqs[j].seq_id))
            tuner.spent("x", "default", 0.001)  # a shadow takes 1 ms
            tuner.ledger.forget(reqs[j].seq_id)  # judged at once, for this test
    allowance = made[:SHADOW_ALLOWANCE]
    assert [r for r, _ in allowance] == list(range(SHADOW_ALLOWANCE))  # one a round
    assert {s for _, s in allowance} == {0, 1, 2, 3}  # in turn among the sequences
    later = [r for r, _ in made[SHADOW_ALLOWANCE:]]
    # then 1 ms of shadows per 0.2 ms saved a round: one in five rounds (the first from what was saved meanwhile)
    assert 40 // 5 - 1 <= len(later) <= 40 // 5 + 4, made
    assert tuner.take_seconds() == pytest.approx(0.001 * len(made))
    assert tuner.take_seconds() == 0.0


def test_a_shadow_waits_until_its_sent_prefixes_are_known_and_a_slot_reused_forgets_it():
    ledger = ShadowLedger()
    sh = Shadow("default", pos=4, drafts=[np.array([7, 8, 9]), np.array([7, 5])], sends=[3, 2],
                time_tokens=np.array([0.1, 0.2, 0.3]), lookup_tokens=[0.01, 0.02])
    ledger.add("x", 0, sh)
    hist = np.array([1, 2, 3, 4, 7, 8, 9, 6])
    assert ledger.due("x", 0, hist[:6]) == []  # two of the three tokens known: it waits
    [(cls, gains)] = ledger.due("x", 0, hist[:7])
    assert cls == "default" and gains == [pytest.approx(3 - 0.3 - 0.01), pytest.approx(1 - 0.2 - 0.02)]
    assert not ledger.waiting("x", 0)
    ledger.add("x", 1, sh)
    ledger.forget(1)
    assert ledger.due("x", 1, hist) == []


def test_grids_are_checked_against_the_speculators_parameters():
    factory = speculator_factory()
    with pytest.raises(ValueError, match="p_mn"):
        DraftPolicy(Chain(ChainConfig(speculators=["suffix"], tune=True, tune_grids={"suffix": [{"p_mn": 0.1}]}),
                          factory))
    with pytest.raises(ValueError, match="suffix"):
        DraftPolicy(Chain(ChainConfig(speculators=["suffix"], tune=True, tune_grids={"suffix": [{"p_min": 2.0}]}),
                          factory))
    chain = Chain(ChainConfig(speculators=["suffix", "ngram_mod"], tune=True, tune_grids={"ngram_mod": []}), factory)
    tuner = DraftPolicy(chain).tuner
    assert tuner.tunes("suffix") and not tuner.tunes("ngram_mod")  # an empty grid: not tuned
    assert DraftPolicy(Chain(ChainConfig(speculators=["suffix"]), factory)).tuner is None  # off by default


class Recorder:
    """A speculator that drafts what its parameter says, recording the parameters of each call."""

    class P:
        def __init__(self, k=1):
            self.k = k

        def model_copy(self, update):
            return Recorder.P(**update)

    def __init__(self):
        self.params = Recorder.P()
        self.calls = []
        self.stats = SpeculatorStats()

    def draft(self, reqs):
        self.calls.append((self.params.k, [r.seq_id for r in reqs]))
        return [np.full(self.params.k, r.seq_id, dtype=np.int32) for r in reqs]


def test_each_request_drafts_with_its_setting_and_the_configured_one_comes_back():
    spec = Recorder()
    chain = Chain(ChainConfig(speculators=["x"]), lambda name, params: spec)
    tuner = ParamTuner({"x": {"k": 1}}, {"x": [{"k": 2}, {"k": 3}]}, explore=0.0)
    for _ in range(8):  # class "a" has found setting 1 ({"k": 2}) best, class "b" setting 2 ({"k": 3})
        tuner.bandit("x", "a").record([0.0, 1.0, 0.5])
        tuner.bandit("x", "b").record([0.0, 0.5, 1.0])
    reqs = [SeqDraftRequest(0, ("x",), np.zeros(4, np.int32), 8, tune_class="a"),
            SeqDraftRequest(1, ("x",), np.zeros(4, np.int32), 8, tune_class=None),  # not tuned
            SeqDraftRequest(2, ("x",), np.zeros(4, np.int32), 8, tune_class="b")]
    drafts = tuned_look_up(chain, "x", reqs, [8, 8, 8], tuner)
    assert [len(d) for d in drafts] == [2, 1, 3]
    assert spec.params.k == 1  # the configured parameters are back
    assert sorted(k for k, _ in spec.calls) == [1, 2, 3]  # one call per setting


def test_a_chain_tuned_from_a_bad_start_finds_a_setting_that_gains():
    """ngram_simple drafting 1 token a round (size_m=1) on a text that repeats itself: longer drafts gain more.
    A simulated target emits the text; every draft is judged against it and priced as a cheap verify."""
    text = np.tile(np.arange(100, 160, dtype=np.int32), 40)
    cfg = ChainConfig(speculators=["ngram_simple"], params={"ngram_simple": {"size_n": 12, "size_m": 1}},
                      tune=True, tune_explore=0.05)
    chain = Chain(cfg, speculator_factory())
    policy = DraftPolicy(chain)
    pricing = Pricing(cost=lambda n: 0.010 + 0.001 * (n - 1), base_tokens=1, n_decoding=1)
    pos = 200
    chain.begin(0, ("ngram_simple",), text[:pos])
    while pos < len(text) - 64:
        prop = policy.propose([SeqDraftRequest(0, ("ngram_simple",), text[:pos], 32)], pricing=pricing)[0]
        d = prop.tokens
        n_acc = int(np.argmin(np.append(d == text[pos:pos + len(d)], False)))  # matching prefix
        emitted = text[pos:pos + n_acc + 1]
        policy.accept(prop, len(d), n_acc, emitted)
        pos += n_acc + 1
    tuning = policy.tuner.to_dict()["ngram_simple"]["default"]
    assert tuning["choice"]["size_m"] > 1, tuning
    start, best = tuning["settings"][0], max(tuning["settings"], key=lambda s: s["gain_per_round"] or -1)
    assert best["gain_per_round"] > start["gain_per_round"] + 1.0, tuning


def test_a_shadow_drafts_with_every_setting_unseen_by_the_counters_and_is_judged_on_what_followed():
    text = np.tile(np.arange(100, 130, dtype=np.int32), 6)
    cfg = ChainConfig(speculators=["ngram_simple"], params={"ngram_simple": {"size_n": 2, "size_m": 2}},
                      tune=True, tune_grids={"ngram_simple": [{"size_m": 8}]})
    chain = Chain(cfg, speculator_factory())
    policy = DraftPolicy(chain)
    spec = chain.instances["ngram_simple"]
    pricing = Pricing(cost=lambda n: 0.010 + 0.001 * (n - 1), base_tokens=1, n_decoding=1)
    chain.begin(0, ("ngram_simple",), text[:100])
    prop = policy.propose([SeqDraftRequest(0, ("ngram_simple",), text[:100], 16)], pricing=pricing)[0]
    assert list(prop.tokens) == list(text[100:102])  # the configured setting's draft was offered
    assert spec.stats.calls == 1  # the shadow's two look-ups are not counted
    [shadow] = policy.tuner.ledger.pending[("ngram_simple", 0)]
    assert [list(d) for d in shadow.drafts] == [list(text[100:102]), list(text[100:108])]
    # what the cost policy would send of each: a fresh tracker's estimates fall with the position
    assert shadow.pos == 100 and shadow.sends == [2, 4], shadow.sends
    policy.accept(prop, 2, 2, text[100:103])
    policy.propose([SeqDraftRequest(0, ("ngram_simple",), text[:103], 16)], pricing=pricing)
    assert policy.tuner.bandits[("ngram_simple", "default")].judged == 0  # 1 of 4 sent tokens still to come
    policy.propose([SeqDraftRequest(0, ("ngram_simple",), text[:112], 16)], pricing=pricing)
    b = policy.tuner.bandits[("ngram_simple", "default")]
    assert b.judged == 2  # that one, and the one made at 103 (at most 8 tokens sent: known by 112)
    g0, g1 = b.gains  # both right to the end: the longer draft gains more, net of its verify time
    assert g1 > g0 > 0, b.gains
    chain.end(0, ("ngram_simple",))
    policy.forget_sequence(0, ("ngram_simple",))
    assert not policy.tuner.ledger.pending  # the shadow made on the last propose is forgotten with the sequence
    assert policy.tuner.to_dict()["ngram_simple"]["default"]["judged"] == 2
