"""Unit tests for specray.engine.sampling (pure numpy, no model)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from specray.engine import sampling
from specray.engine.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    make_rng,
    penalty_window,
    sample_token,
    target_probs,
)

# A hand-made distribution: softmax(log p) == p exactly (up to rounding).
P5 = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
L5 = np.log(P5).astype(np.float32)


def support(p: np.ndarray) -> set[int]:
    return set(np.flatnonzero(p > 0).tolist())


# ---------------------------------------------------------------- params


def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert p.temperature == 0.0 and p.greedy
    assert p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert p.repeat_penalty == 1.0 and p.repeat_last_n == 64 and p.seed is None
    assert not p.penalty_active
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(repeat_penalty=1.1).penalty_active
    assert not SamplingParams(repeat_penalty=1.1, repeat_last_n=0).penalty_active


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -1},
        {"bogus": 1},
    ],
)
def test_params_validation(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


def test_params_fields_documented():
    for name, f in SamplingParams.model_fields.items():
        assert f.description, name


# ---------------------------------------------------------------- penalty


def test_repetition_penalty_hand_computed():
    logits = np.array([2.0, -1.0, 0.5, 0.0, 3.0], dtype=np.float32)
    recent = np.array([0, 1, 0, 3, 0], dtype=np.int32)  # token 0 thrice: penalised once
    out = apply_repetition_penalty(logits, recent, 2.0)
    np.testing.assert_array_equal(out, np.array([1.0, -2.0, 0.5, 0.0, 3.0], dtype=np.float32))
    assert out.dtype == np.float32
    # input untouched (a copy is returned)
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 0.0, 3.0])
    # penalty < 1 boosts: positive divided, non-positive multiplied
    out = apply_repetition_penalty(logits, np.array([0, 1]), 0.5)
    np.testing.assert_allclose(out, [4.0, -0.5, 0.5, 0.0, 3.0])
    # empty window / penalty 1 -> unchanged copy; out-of-range ids ignored
    np.testing.assert_array_equal(apply_repetition_penalty(logits, np.array([], np.int32), 2.0), logits)
    np.testing.assert_array_equal(apply_repetition_penalty(logits, recent, 1.0), logits)
    np.testing.assert_array_equal(apply_repetition_penalty(logits, np.array([-1, 99]), 2.0), logits)


def test_penalty_window_last_n():
    h = np.arange(10)
    np.testing.assert_array_equal(penalty_window(h, 3), [7, 8, 9])
    np.testing.assert_array_equal(penalty_window(h, 64), h)
    assert penalty_window(h, 0).size == 0
    assert penalty_window(None, 5).size == 0


def test_target_probs_uses_only_last_n_for_penalty():
    logits = np.array([2.0, 2.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, repeat_penalty=2.0, repeat_last_n=1)
    # token 0 is outside the window of 1, token 1 inside -> only token 1 penalised
    p = target_probs(logits, params, np.array([0, 1]))
    np.testing.assert_allclose(p, np.exp([2.0, 1.0, 0.0]) / np.exp([2.0, 1.0, 0.0]).sum())


# ---------------------------------------------------------------- filters


def test_plain_softmax_is_stable_and_float64():
    logits = np.array([1000.0, 999.0, 998.0], dtype=np.float32)
    p = target_probs(logits, SamplingParams(temperature=1.0))
    assert p.dtype == np.float64
    e = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose(p, e / e.sum(), rtol=1e-12)


def test_top_k():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert support(p) == {0, 1, 2}
    e = np.exp([2.0, 1.0, 0.5])
    np.testing.assert_allclose(p[:3], e / e.sum(), rtol=1e-12)
    # top_k >= V is a no-op
    full = target_probs(logits, SamplingParams(temperature=1.0, top_k=100))
    np.testing.assert_allclose(full, np.exp(logits.astype(float)) / np.exp(logits.astype(float)).sum())


def test_top_p():
    # cum = 0.4, 0.7, 0.85, 0.95, 1.0 ; top_p=0.65 keeps the first 2
    p = target_probs(L5, SamplingParams(temperature=1.0, top_p=0.65))
    assert support(p) == {0, 1}
    np.testing.assert_allclose(p[:2], [4 / 7, 3 / 7], rtol=1e-6)
    p = target_probs(L5, SamplingParams(temperature=1.0, top_p=0.9))
    assert support(p) == {0, 1, 2, 3}
    np.testing.assert_allclose(p[:4], P5[:4] / 0.95, rtol=1e-6)
    # the best token always survives
    p = target_probs(L5, SamplingParams(temperature=1.0, top_p=0.01))
    np.testing.assert_array_equal(p, [1, 0, 0, 0, 0])


def test_min_p():
    # p_max = 0.4; min_p=0.3 -> threshold 0.12 keeps 0.4, 0.3, 0.15
    p = target_probs(L5, SamplingParams(temperature=1.0, min_p=0.3))
    assert support(p) == {0, 1, 2}
    np.testing.assert_allclose(p[:3], P5[:3] / 0.85, rtol=1e-6)
    p = target_probs(L5, SamplingParams(temperature=1.0, min_p=1.0))
    np.testing.assert_array_equal(p, [1, 0, 0, 0, 0])


def test_temperature():
    # softmax(log p / T) = p^(1/T) normalised
    for T in (0.5, 2.0):
        p = target_probs(L5, SamplingParams(temperature=T))
        ref = P5 ** (1 / T)
        np.testing.assert_allclose(p, ref / ref.sum(), rtol=1e-6)


def test_temperature_zero_is_one_hot_argmax():
    logits = np.array([0.0, 3.0, 3.0, 1.0], dtype=np.float32)
    np.testing.assert_array_equal(target_probs(logits, SamplingParams()), [0, 1, 0, 0])


# ---------------------------------------------------------------- pipeline order


def test_order_penalty_before_top_k():
    logits = np.array([3.0, 2.0, 1.8, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=2, repeat_penalty=2.0)
    # token 0 -> 1.5, so the top 2 are tokens 1 and 2
    p = target_probs(logits, params, np.array([0]))
    assert support(p) == {1, 2}
    e = np.exp([2.0, 1.8])
    np.testing.assert_allclose(p[[1, 2]], e / e.sum(), rtol=1e-6)


def test_order_top_k_before_top_p():
    # top_k=3 renormalises to .47,.35,.18 -> top_p .8 keeps 2
    # (top_p first on the full row would keep 3)
    p = target_probs(L5, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert support(p) == {0, 1}


def test_order_top_p_before_min_p():
    # top_p .8 on the full row keeps 3 (.4,.7,.85), min_p .3 keeps those 3.
    # (min_p first then top_p on the renormalised set would keep only 2)
    p = target_probs(L5, SamplingParams(temperature=1.0, top_p=0.8, min_p=0.3))
    assert support(p) == {0, 1, 2}
    np.testing.assert_allclose(p[:3], P5[:3] / 0.85, rtol=1e-6)


def test_order_filters_before_temperature():
    # top_p / min_p use temperature-1 probabilities; temperature reshapes the
    # survivors only. With T=2 first the row would be flatter and top_p .65
    # would keep 3 tokens.
    p = target_probs(L5, SamplingParams(temperature=2.0, top_p=0.65))
    assert support(p) == {0, 1}
    r = np.sqrt(P5[:2])
    np.testing.assert_allclose(p[:2], r / r.sum(), rtol=1e-6)
    p = target_probs(L5, SamplingParams(temperature=0.25, min_p=0.3))
    assert support(p) == {0, 1, 2}
    r = P5[:3] ** 4
    np.testing.assert_allclose(p[:3], r / r.sum(), rtol=1e-6)


# ---------------------------------------------------------------- big vocab


def _ref_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Straightforward full-sort reference of the chain (no penalties)."""
    x = logits.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    keep = order
    if params.top_k:
        keep = keep[: params.top_k]
    if params.top_p < 1:
        w = np.exp(x[keep] - x[keep].max())
        cum = np.cumsum(w / w.sum())
        n = int(np.searchsorted(cum, params.top_p)) + 1
        keep = keep[:n]
    if params.min_p > 0:
        keep = keep[x[keep] >= x[keep].max() + np.log(params.min_p)]
    out = np.zeros_like(x)
    z = x[keep] / params.temperature
    z = np.exp(z - z.max())
    out[keep] = z / z.sum()
    return out


def lm_like_logits(seed: int, V: int = 50_000, n_peak: int = 30, peak: float = 12.0, scale: float = 1.0):
    """Random logits with n_peak tokens far above the rest (like a real LM row)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(V) * scale
    x[rng.choice(V, n_peak, replace=False)] += peak + rng.standard_normal(n_peak)
    return x.astype(np.float32)


@pytest.mark.parametrize(
    "peak,kw",
    [
        (12.0, {"top_p": 0.9}),  # peaked: the first 256-candidate pass suffices
        (0.0, {"top_p": 0.9}),  # flat: falls back to the full sort
        (12.0, {"top_p": 0.999999}),  # peaked but top_p needs the long tail
        (0.0, {"top_k": 40}),
        (0.0, {"top_k": 1000, "top_p": 0.5, "min_p": 0.01}),
        (12.0, {"top_k": 1000, "top_p": 0.5}),
        (0.0, {"min_p": 0.05}),
        (12.0, {"min_p": 0.05}),
    ],
)
def test_large_vocab_matches_full_sort_reference(peak, kw):
    logits = lm_like_logits(7, peak=peak)
    params = SamplingParams(temperature=0.8, **kw)
    p = target_probs(logits, params)
    ref = _ref_probs(logits, params)
    assert support(p) == support(ref)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-15)
    assert abs(p.sum() - 1.0) < 1e-12


def test_large_vocab_does_only_the_needed_sorting(monkeypatch):
    """top_k uses argpartition, top_p sorts only the candidates left; no sort when off."""
    sorted_sizes: list[int] = []
    real_argsort, real_sort = np.argsort, np.sort

    def spy_argsort(a, *args, **kwargs):
        sorted_sizes.append(np.asarray(a).size)
        return real_argsort(a, *args, **kwargs)

    def spy_sort(a, *args, **kwargs):
        sorted_sizes.append(np.asarray(a).size)
        return real_sort(a, *args, **kwargs)

    monkeypatch.setattr(sampling.np, "argsort", spy_argsort)
    monkeypatch.setattr(sampling.np, "sort", spy_sort)
    logits = lm_like_logits(3)

    target_probs(logits, SamplingParams(temperature=0.8))
    target_probs(logits, SamplingParams(temperature=0.8, top_k=40, min_p=0.1))
    assert sorted_sizes == []
    target_probs(logits, SamplingParams(temperature=0.8, top_k=40, top_p=0.9))
    assert max(sorted_sizes) <= 40
    sorted_sizes.clear()
    target_probs(logits, SamplingParams(temperature=0.8, top_p=0.9))
    assert max(sorted_sizes) <= 256


# ---------------------------------------------------------------- drawing


def test_sample_token_never_picks_zero_probability():
    rng = make_rng(0)
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = {sample_token(probs, rng) for _ in range(2000)}
    assert draws == {1, 3}
    assert sample_token(np.array([0.0, 0.0, 1.0]), rng) == 2


def test_sample_token_distribution_and_unnormalised_input():
    from scipy.stats import chisquare

    rng = make_rng(1)
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    counts = np.bincount([sample_token(probs * 5.0, rng) for _ in range(n)], minlength=4)
    assert chisquare(counts, probs * n).pvalue > 0.001


def test_sample_token_rejects_zero_mass():
    with pytest.raises(ValueError):
        sample_token(np.zeros(3), make_rng(0))


def test_make_rng_seeded_and_fresh():
    a = make_rng(42).random(5)
    b = make_rng(42).random(5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(make_rng(43).random(5), a)
    assert not np.array_equal(make_rng(None).random(5), make_rng(None).random(5))
