"""The per-draft estimates run in Python floats (acceptance.prefix_probs, calibration.apply and its factors,
chain.draft_value and the round's time curve): they must give bitwise what their numpy formulas give, for every
state, context and length."""

from __future__ import annotations

import numpy as np

from specray.engine.policy.acceptance import AcceptanceTracker, pos_buckets
from specray.engine.policy.calibration import P_MAX, FACTOR_MAX, FACTOR_MIN, PrefixCalibration
from specray.engine.policy.pricing import Pricing, draft_value


def _trained(seed: int) -> AcceptanceTracker:
    rng = np.random.default_rng(seed)
    t = AcceptanceTracker(n_contexts=12)
    for _ in range(400):
        k = int(rng.integers(1, 12))
        t.update(int(rng.integers(0, 5)), k, int(rng.integers(0, k + 1)), bool(rng.random() < 0.2),
                 int(rng.integers(0, 12)))
    return t


def test_prefix_probs_equal_the_running_product_of_conditional():
    for seed in range(3):
        t = _trained(seed)
        for seq_id in range(7):  # 5, 6: sequences never seen
            for length in (1, 2, 3, 6, 9, 40, 300):  # past max_positions (256) too
                for ctx in (-1, 0, 5, 11, 40):  # out-of-range contexts are clamped
                    want = np.cumprod(t.conditional(seq_id, length, ctx))
                    assert np.array_equal(t.prefix_probs(seq_id, length, ctx), want), (seed, seq_id, length, ctx)
    assert len(AcceptanceTracker().prefix_probs(0, 0)) == 0


def _numpy_factors(c: PrefixCalibration) -> np.ndarray:
    k = np.where(c.realised > c.predicted, c.raise_prior_tokens, c.prior_tokens)
    return np.clip((c.realised + k) / (c.predicted + k), FACTOR_MIN, FACTOR_MAX)


def test_calibration_apply_equals_its_numpy_formula():
    rng = np.random.default_rng(7)
    c = PrefixCalibration()
    for step in range(60):
        raw = np.cumprod(rng.uniform(0.3, 1.0, int(rng.integers(1, 20))))
        assert np.array_equal(c.factors(), _numpy_factors(c)), step
        want = np.minimum.accumulate(np.minimum(raw * _numpy_factors(c)[pos_buckets(len(raw))], P_MAX))
        assert np.array_equal(c.apply(raw), want), step
        c.update(raw, int(rng.integers(0, len(raw) + 1)))  # the factors move: the cached floats must follow
    assert len(c.apply(np.zeros(0))) == 0


def test_draft_value_equals_its_numpy_formula():
    rng = np.random.default_rng(3)
    for base_tokens, n_decoding in ((1, 1), (4, 4), (9, 8)):
        pricing = Pricing(cost=lambda n: 0.0016 if n == 1 else 0.0025 if n <= 8 else 0.0025 + 0.0002 * (n - 8),
                          base_tokens=base_tokens, n_decoding=n_decoding)
        for n in (1, 2, 5, 12, 3, 30):  # the memo grows, then is sliced
            pp = np.cumprod(rng.uniform(0.2, 1.0, n))
            gains = np.cumsum(pp)
            base = pricing.cost(base_tokens)
            time = (np.array([pricing.cost(base_tokens + k) for k in range(1, n + 1)]) - base) * (n_decoding / base)
            assert np.array_equal(pricing.time_in_tokens(n), time)
            assert draft_value(pp, pricing) == float(max(0.0, np.max(gains - time)))
            assert draft_value(pp, None) == float(gains[-1])
    free = Pricing(cost=lambda n: 0.0, base_tokens=1, n_decoding=1)  # a free round: the whole draft's gain
    assert draft_value(np.array([0.5, 0.25]), free) == 0.75


class _EveryUpdateFades(AcceptanceTracker):
    """The tracker as it was: every update looks at its cell and the position counts for the cap."""

    def update(self, seq_id, n_drafted, n_accepted, censored=False, context=0):
        self._cell_bound.clear()  # no bound carried: the base class checks the cell on every update
        st, ctx = self.state(seq_id), min(max(int(context), 0), self.n_contexts - 1)
        super().update(seq_id, n_drafted, n_accepted, censored, context)
        self._fade(st, ctx)


def test_updates_fade_cells_as_when_every_update_looked():
    # far past CELL_CAP (4096 trials a cell), one context and state mostly, so cells are scaled many times
    rng = np.random.default_rng(11)
    fast, ref = AcceptanceTracker(n_contexts=2), _EveryUpdateFades(n_contexts=2)
    for _ in range(6000):
        k = int(rng.integers(1, 40))
        args = (int(rng.integers(0, 2)), k, int(rng.integers(0, k + 1)), bool(rng.random() < 0.1),
                int(rng.integers(0, 2)))
        fast.update(*args)
        ref.update(*args)
    assert ref.state_trials.max() == 4096.0 and ref.pos_trials[0] == 4096.0  # both caps were reached
    assert np.array_equal(fast.state_trials, ref.state_trials) and np.array_equal(fast.state_acc, ref.state_acc)
    assert np.array_equal(fast.pos_trials, ref.pos_trials) and fast.global_trials == ref.global_trials
