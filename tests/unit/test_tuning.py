"""Online tuning of the speculators' look-up parameters (engine/tuning.py): the bandit, its bounds, the grid
checks, the per-setting look-ups, and a chain that finds a better setting than its bad start."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.chain import Chain, Pricing, SeqDraftRequest
from specray.engine.config import ChainConfig
from specray.engine.speculators.registry import speculator_factory
from specray.engine.tuning import ALLOWANCE_PER_SETTING, MIN_ROUNDS, Bandit, ParamTuner, draft_tuned


def test_the_bandit_settles_on_the_best_setting_and_explores_within_its_budget():
    rng = np.random.default_rng(0)
    means = [0.1, 0.8, 0.3, -0.2]  # tokens gained a round by setting; 0 is the configured one
    b = Bandit([{}] * 4, explore=0.02)
    picks = []
    for _ in range(3000):
        i = b.choose()
        picks.append(i)
        b.reward(i, means[i] + rng.normal(0, 0.5))
    assert b.best() == 1
    assert picks[-500:].count(1) >= 450  # exploiting once it knows
    # exploring: at most the start-up allowance plus the share
    assert b.explored <= ALLOWANCE_PER_SETTING * 3 + 0.02 * 3000 + 1
    # the allowance is paced: never two explorations in a row while only the allowance pays
    assert b.explored >= ALLOWANCE_PER_SETTING * 3


def test_a_setting_that_stops_paying_is_left_and_one_judged_long_ago_is_looked_at_again():
    """Gains drift. Setting 1 wins for 2000 rounds, then loses: discounted records let the bandit leave it
    within a few hundred rounds (undiscounted ones hold the early verdict about 1000 rounds longer). Setting 2
    lost early and wins later: it is looked at again and taken."""
    rng = np.random.default_rng(1)
    b = Bandit([{}] * 3, explore=0.05)
    picks = []
    for t in range(5000):
        means = [0.2, 0.9 if t < 2000 else -0.3, -0.3 if t < 2000 else 0.6]
        i = b.choose()
        picks.append(i)
        b.reward(i, means[i] + rng.normal(0, 0.5))
    assert picks[1500:2000].count(1) > 400  # it had settled on setting 1
    assert picks[2500:3000].count(2) > 400  # within 500 rounds of the change (undiscounted: 25 of 500)
    assert picks[-1500:].count(2) > 1200 and b.best() == 2, b.to_dict({})


def test_the_configured_setting_holds_until_another_has_shown_better():
    b = Bandit([{}] * 3, explore=0.0)
    b.credits = b.allowance = 0  # no exploring at all
    assert {b.choose() for _ in range(20)} == {0}
    for _ in range(int(MIN_ROUNDS)):  # 7 recent rounds: short of the 7.5 needed
        b.reward(2, 5.0)
    assert b.best() == 0  # not enough rounds to trust setting 2 yet
    b.reward(2, 5.0)
    assert b.best() == 2


def test_grids_are_checked_against_the_speculators_parameters():
    factory = speculator_factory()
    with pytest.raises(ValueError, match="p_mn"):
        Chain(ChainConfig(speculators=["suffix"], tune=True, tune_grids={"suffix": [{"p_mn": 0.1}]}), factory)
    with pytest.raises(ValueError, match="suffix"):
        Chain(ChainConfig(speculators=["suffix"], tune=True, tune_grids={"suffix": [{"p_min": 2.0}]}), factory)
    chain = Chain(ChainConfig(speculators=["suffix", "ngram_mod"], tune=True, tune_grids={"ngram_mod": []}), factory)
    assert chain.tuner.tunes("suffix") and not chain.tuner.tunes("ngram_mod")  # an empty grid: not tuned
    assert Chain(ChainConfig(speculators=["suffix"]), factory).tuner is None  # off by default


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

    def draft(self, reqs):
        self.calls.append((self.params.k, [r.seq_id for r in reqs]))
        return [np.full(self.params.k, r.seq_id, dtype=np.int32) for r in reqs]


def test_each_request_drafts_with_its_setting_and_the_configured_one_comes_back():
    spec = Recorder()
    tuner = ParamTuner({"x": {"k": 1}}, {"x": [{"k": 2}, {"k": 3}]}, explore=0.0)
    reqs = [SeqDraftRequest(0, ("x",), np.zeros(4, np.int32), 8, tune_class="a"),
            SeqDraftRequest(1, ("x",), np.zeros(4, np.int32), 8, tune_class=None),  # not tuned
            SeqDraftRequest(2, ("x",), np.zeros(4, np.int32), 8, params={"x": {"k": 3}})]  # its own
    drafts, settings = draft_tuned(spec, "x", reqs, [8, 8, 8], tuner)
    assert [len(d) for d in drafts] == [2, 1, 3]  # class "a" explores setting 1 first ({"k": 2})
    assert settings == [1, -1, -1]
    assert spec.params.k == 1  # the configured parameters are back
    assert sorted(k for k, _ in spec.calls) == [1, 2, 3]  # one call per setting


def test_a_chain_tuned_from_a_bad_start_finds_a_setting_that_gains():
    """ngram_simple drafting 1 token a round (size_m=1) on a text that repeats itself: longer drafts gain more.
    A simulated target emits the text; every draft is judged against it and priced as a cheap verify."""
    text = np.tile(np.arange(100, 160, dtype=np.int32), 40)
    cfg = ChainConfig(speculators=["ngram_simple"], params={"ngram_simple": {"size_n": 12, "size_m": 1}},
                      tune=True, tune_explore=0.05)
    chain = Chain(cfg, speculator_factory())
    pricing = Pricing(cost=lambda n: 0.010 + 0.001 * (n - 1), base_tokens=1, n_decoding=1)
    pos = 200
    chain.begin(0, ("ngram_simple",), text[:pos])
    while pos < len(text) - 64:
        prop = chain.propose([SeqDraftRequest(0, ("ngram_simple",), text[:pos], 32)], pricing=pricing)[0]
        d = prop.tokens
        n_acc = int(np.argmin(np.append(d == text[pos:pos + len(d)], False)))  # matching prefix
        emitted = text[pos:pos + n_acc + 1]
        chain.accept(prop, len(d), n_acc, emitted)
        pos += n_acc + 1
    tuning = chain.tuner.to_dict()["ngram_simple"]["default"]
    assert tuning["choice"]["size_m"] > 1, tuning
    start, best = tuning["settings"][0], max(tuning["settings"], key=lambda s: s["gain_per_round"] or -1)
    assert best["gain_per_round"] > start["gain_per_round"] + 1.0, tuning
