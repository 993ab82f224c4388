"""Unit tests for specray.engine.verify (greedy + rejection sampling)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specray.engine.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    make_rng,
    penalty_window,
    sample_token,
    target_probs,
)
from specray.engine.verify import Verdict, verify_greedy, verify_sampled


def block(*argmaxes: int, V: int = 8) -> np.ndarray:
    """[len, V] float32 logits whose row i has its argmax at argmaxes[i]."""
    rows = np.zeros((len(argmaxes), V), dtype=np.float32)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


def D(*tokens: int) -> np.ndarray:
    """A draft as an int32 array."""
    return np.array(tokens, dtype=np.int32)


def support(p: np.ndarray) -> set[int]:
    return set(np.flatnonzero(p > 0).tolist())


# ================================================================ greedy


def test_greedy_all_accepted_takes_bonus_from_last_row():
    v = verify_greedy(block(3, 1, 4, 6), D(3, 1, 4))
    assert v == (3, 6) and isinstance(v, Verdict)
    assert v.n_accepted == 3 and v.next_token == 6


def test_greedy_first_token_rejected():
    assert verify_greedy(block(2, 1, 4, 6), D(3, 1, 4)) == (0, 2)


def test_greedy_middle_rejected():
    # row 1 wants 7, draft says 1: keep 1 token, correction 7 (later rows ignored)
    assert verify_greedy(block(3, 7, 4, 6), D(3, 1, 4)) == (1, 7)
    assert verify_greedy(block(3, 1, 0, 6), D(3, 1, 4)) == (2, 0)


def test_greedy_empty_draft():
    assert verify_greedy(block(5), D()) == (0, 5)
    assert verify_greedy(block(5), np.zeros(0, dtype=np.int32), params=SamplingParams(repeat_penalty=1.3)) == (0, 5)


def test_greedy_shape_checks():
    with pytest.raises(ValueError):
        verify_greedy(block(1, 2), D(1, 2))  # needs k+1 = 3 rows
    with pytest.raises(ValueError):
        verify_greedy(block(1, 2), D(99))  # id out of vocab


def test_greedy_reads_no_row_after_the_first_mismatch():
    """Rows are argmaxed one by one up to the first rejected draft token (each is a whole vocabulary): a row
    after it is never read, so NaNs there cannot change the verdict; the verdicts equal one argmax over the
    block, ties (lowest id) included, over random drafts that match for a random prefix."""
    class Unread:  # a logit no comparison may touch
        def _boom(self, other):
            raise AssertionError("a row after the first mismatch was read")
        __gt__ = __lt__ = __ge__ = __le__ = __eq__ = _boom

    rows = block(3, 7, 4, 6).astype(object)
    rows[2:] = Unread()
    assert verify_greedy(rows, D(3, 1, 4), params=SamplingParams(temperature=0.5)) == (1, 7)
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(0, 6))
        logits = rng.integers(0, 4, size=(k + 1, 16)).astype(np.float32)  # few values: many ties
        am = np.argmax(logits, axis=1)
        m = int(rng.integers(0, k + 1))
        draft = np.concatenate([am[:m], rng.integers(0, 16, size=k - m)]).astype(np.int32)
        mismatch = np.flatnonzero(am[:k] != draft)
        n = int(mismatch[0]) if mismatch.size else k
        assert verify_greedy(logits, draft) == (n, int(am[n]))


def _greedy_one_by_one(logits, draft, recent, params):
    """Reference: decode greedily token by token with the penalty."""
    hist = list(recent)
    out = []
    for i in range(len(draft) + 1):
        row = apply_repetition_penalty(
            logits[i], penalty_window(np.array(hist), params.repeat_last_n), params.repeat_penalty
        )
        tok = int(np.argmax(row))
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            break
        hist.append(tok)
    return len(out) - 1, out[-1]


def test_greedy_with_penalty_matches_one_by_one_loop():
    # hand case: row 1 would pick token 0 again, but token 0 was just accepted
    logits = np.array(
        [
            [3.0, 1.0, 0.0, 0.0],
            [3.0, 2.0, 0.0, 0.0],
            [0.0, 0.0, 3.0, 0.0],
        ],
        dtype=np.float32,
    )
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=8)
    assert verify_greedy(logits, D(0, 0), np.array([2]), None) == (2, 2)  # no penalty
    assert verify_greedy(logits, D(0, 0), np.array([2]), params) == (1, 1)  # 3/2 < 2
    # row 1 -> [1.5, 2, 0, 0] picks 1; row 2 -> [0, 0, 1.5, 0] still picks 2
    assert verify_greedy(logits, D(0, 1), np.array([2]), params) == (2, 2)
    assert _greedy_one_by_one(logits, D(0, 1), [2], params) == verify_greedy(logits, D(0, 1), np.array([2]), params)

    # randomised against the reference loop
    rng = np.random.default_rng(11)
    V = 12
    for trial in range(300):
        k = int(rng.integers(0, 6))
        params = SamplingParams(
            repeat_penalty=float(rng.choice([0.7, 1.3, 2.5])), repeat_last_n=int(rng.choice([1, 3, 64]))
        )
        base = rng.standard_normal(V).astype(np.float32)
        logits = (base + 0.3 * rng.standard_normal((k + 1, V))).astype(np.float32)
        recent = rng.integers(0, V, size=int(rng.integers(0, 10)))
        # drafts mostly following the penalised greedy path, so acceptance varies
        draft = []
        hist = list(recent)
        for i in range(k):
            row = apply_repetition_penalty(logits[i], penalty_window(np.array(hist), params.repeat_last_n), params.repeat_penalty)
            t = int(np.argmax(row)) if rng.random() < 0.8 else int(rng.integers(0, V))
            draft.append(t)
            hist.append(t)
        draft = np.array(draft, dtype=np.int32)
        assert verify_greedy(logits, draft, recent, params) == _greedy_one_by_one(logits, draft, recent, params), trial


def test_sampled_with_temperature_zero_is_greedy():
    rng = make_rng(0)
    state = rng.bit_generator.state
    assert verify_sampled(block(3, 7, 4), D(3, 1), SamplingParams(), rng, None) == (1, 7)
    assert rng.bit_generator.state == state  # nothing drawn


# ================================================================ rejection sampling: statistics

V = 6
TARGET_LOGITS = np.log(np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])).astype(np.float32)
Q = np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # draft distribution, very different
N = 20_000
K = 2


def emitted(draft: np.ndarray, verdict: tuple[int, int]) -> list[int]:
    n, nxt = verdict
    return [int(t) for t in draft[:n]] + [nxt]


def gof_pvalue(tokens, p: np.ndarray) -> float:
    """chi-square goodness of fit of the observed tokens against p.

    Tokens with p == 0 must never appear (else the fit is rejected outright).
    """
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=p.shape[0])
    if counts[p == 0].sum():
        return 0.0
    s = p > 0
    return float(chisquare(counts[s], p[s] / p[s].sum() * counts[s].sum()).pvalue)


def run_trials(verifier, params, q, *, use_q: bool, seed: int, n: int = N, k: int = K, logits=None, recent=None):
    """Draft from q, verify, collect (first emitted, second emitted | first draft accepted)."""
    rng = make_rng(seed)
    if logits is None:
        logits = np.tile(TARGET_LOGITS, (k + 1, 1))
    draft_probs = np.tile(q, (k, 1)) if use_q else None
    cdf = np.cumsum(q)
    all_drafts = np.minimum(np.searchsorted(cdf, rng.random((n, k)) * cdf[-1], side="right"), len(q) - 1).astype(np.int32)
    first, second, verdicts = [], [], []
    for t in range(n):
        d = all_drafts[t]
        v = verifier(logits, d, params, rng, recent, draft_probs)
        toks = emitted(d, v)
        first.append(toks[0])
        if v[0] >= 1:
            second.append(toks[1])
        verdicts.append(v)
    return first, second, verdicts


def always_accept(logits, draft, params, rng, recent, draft_probs):
    """A wrong verifier: keeps every draft token."""
    p = target_probs(logits[len(draft)], params, recent)
    return len(draft), sample_token(p, rng)


def resample_from_p(logits, draft, params, rng, recent, draft_probs):
    """A subtly wrong verifier: right acceptance test, but resamples from p (not the residual)."""
    for i, d in enumerate(draft):
        p = target_probs(logits[i], params, recent)
        q = 1.0 if draft_probs is None else draft_probs[i][d]
        if rng.random() >= p[d] / q:
            return i, sample_token(p, rng)
    return len(draft), sample_token(target_probs(logits[-1], params, recent), rng)


T1 = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("use_q", [False, True], ids=["one-hot-q", "draft-probs-q"])
def test_rejection_sampling_matches_target(use_q):
    p = target_probs(TARGET_LOGITS, T1)
    first, second, verdicts = run_trials(verify_sampled, T1, Q, use_q=use_q, seed=1234)
    assert gof_pvalue(first, p) > 0.001
    assert len(second) > 2000  # the chain is exercised
    assert gof_pvalue(second, p) > 0.001
    # every outcome happens: rejections at 0, at 1, and full acceptance with bonus
    assert {v[0] for v in verdicts} == {0, 1, 2}
    # acceptance rate of the first position matches theory
    acc = np.mean([v[0] >= 1 for v in verdicts])
    expect = p @ Q if not use_q else np.minimum(p, Q).sum()
    assert abs(acc - expect) < 4 * np.sqrt(expect * (1 - expect) / N)


@pytest.mark.parametrize("use_q", [False, True], ids=["one-hot-q", "draft-probs-q"])
def test_wrong_verifiers_fail_the_same_test(use_q):
    """The test has power: broken verifiers are rejected decisively."""
    p = target_probs(TARGET_LOGITS, T1)
    first, second, _ = run_trials(always_accept, T1, Q, use_q=use_q, seed=1234)
    assert gof_pvalue(first, p) < 1e-6
    assert gof_pvalue(second, p) < 1e-6
    if use_q:
        first, _, _ = run_trials(resample_from_p, T1, Q, use_q=True, seed=1234)
        assert gof_pvalue(first, p) < 1e-6


def test_rejection_sampling_applies_temperature_and_top_k():
    params = SamplingParams(temperature=0.6, top_k=4)
    p = target_probs(TARGET_LOGITS, params)
    assert support(p) == {0, 1, 2, 3}
    raw = target_probs(TARGET_LOGITS, T1)  # softmax of the raw logits
    # explicit q: the draft puts mass on tokens top_k removed (p == 0 there)
    first, second, _ = run_trials(verify_sampled, params, Q, use_q=True, seed=99)
    assert gof_pvalue(first, p) > 0.001
    assert gof_pvalue(second, p) > 0.001
    assert gof_pvalue(first, raw) < 1e-6
    # one-hot q (cheaper check, fewer trials, same conclusion)
    first, _, _ = run_trials(verify_sampled, params, Q, use_q=False, seed=98, n=8000, k=1)
    assert gof_pvalue(first, p) > 0.001
    assert gof_pvalue(first, raw) < 1e-6


def test_rejection_sampling_chain_uses_progressive_penalty_window():
    """Row 1 is penalised over recent + the accepted draft[0]."""
    params = SamplingParams(temperature=1.0, repeat_penalty=3.0, repeat_last_n=4)
    recent = np.array([5], dtype=np.int32)
    logits = np.tile(np.array([2.0, 1.5, 1.0, 0.5, 0.0, 1.0], dtype=np.float32), (3, 1))
    q0 = np.zeros(V)
    q0[0] = 1.0  # always draft token 0 first ...
    q = np.array([0.1, 0.3, 0.2, 0.2, 0.1, 0.1])  # ... then from q
    rng = make_rng(5)
    n = 12_000
    draft_probs = np.stack([q0, q])
    d1 = np.searchsorted(np.cumsum(q), rng.random(n) * q.sum(), side="right")
    seconds = []
    for t in range(n):
        d = np.array([0, d1[t]], dtype=np.int32)
        v = verify_sampled(logits, d, params, rng, recent, draft_probs)
        if v[0] >= 1:
            seconds.append(emitted(d, v)[1])
    right = target_probs(logits[1], params, np.array([5, 0]))
    stale = target_probs(logits[1], params, recent)  # window not advanced
    assert len(seconds) > 3000
    assert gof_pvalue(seconds, right) > 0.001
    assert gof_pvalue(seconds, stale) < 1e-6


# ================================================================ edge cases


def test_sampled_empty_draft_samples_row0():
    params = SamplingParams(temperature=1.0, top_k=1)
    assert verify_sampled(block(4), D(), params, make_rng(0), None) == (0, 4)


def test_sampled_zero_target_prob_draft_always_rejected():
    # top_k=1 makes p one-hot at token 4: any other draft is rejected, correction is 4
    params = SamplingParams(temperature=1.0, top_k=1)
    rng = make_rng(0)
    for _ in range(50):
        assert verify_sampled(block(4, 4), D(2), params, rng, None) == (0, 4)
        assert verify_sampled(block(4, 4), D(4), params, rng, None) == (1, 4)


def test_sampled_degenerate_residual_falls_back_to_p():
    # q == p exactly: always accept; with q >= p everywhere the residual has
    # no mass, which must not crash
    params = SamplingParams(temperature=1.0)
    logits = np.tile(TARGET_LOGITS, (2, 1))
    p = target_probs(TARGET_LOGITS, params)
    rng = make_rng(0)
    for t in range(6):
        assert verify_sampled(logits, D(t), params, rng, None, p[None, :])[0] == 1
    # q >= p everywhere (here an unnormalised q = 2p): rejections happen with
    # probability 1/2 and their residual max(p - q, 0) is all zero -> draw from p
    q = 2.0 * p
    rejected = []
    for _ in range(4000):
        n, nxt = verify_sampled(logits, D(0), params, rng, None, q[None, :])
        if n == 0:
            rejected.append(nxt)
    assert 1500 < len(rejected) < 2500
    assert gof_pvalue(rejected, p) > 0.001


def test_sampled_inconsistent_q_zero_at_draft():
    # q(d) == 0 is treated as one-hot q (no division by zero)
    params = SamplingParams(temperature=1.0)
    logits = np.tile(TARGET_LOGITS, (2, 1))
    q = np.array([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    n, nxt = verify_sampled(logits, D(0), params, make_rng(3), None, q)
    assert n in (0, 1) and 0 <= nxt < V


def test_sampled_shape_checks():
    params = SamplingParams(temperature=1.0)
    logits = np.tile(TARGET_LOGITS, (3, 1))
    with pytest.raises(ValueError):
        verify_sampled(logits, D(1), params, make_rng(0), None)
    with pytest.raises(ValueError):
        verify_sampled(logits, D(1, 2), params, make_rng(0), None, np.ones((1, V)) / V)


# ================================================================ reproducibility


def _sequence(seed: int, use_q: bool) -> list[tuple[int, int]]:
    params = SamplingParams(temperature=0.9, top_p=0.95, repeat_penalty=1.1, seed=seed)
    rng = make_rng(params.seed)
    gen = np.random.default_rng(2024)  # fixed inputs, independent of the seed under test
    out = []
    hist = [1, 2, 3]
    for _ in range(200):
        logits = gen.standard_normal((4, 50)).astype(np.float32)
        q = gen.dirichlet(np.ones(50), size=3)
        draft = np.array([gen.choice(50, p=qi) for qi in q], dtype=np.int32)
        v = verify_sampled(logits, draft, params, rng, np.array(hist), q if use_q else None)
        out.append(tuple(v))
        hist += emitted(draft, v)
    return out


@pytest.mark.parametrize("use_q", [False, True])
def test_same_seed_reproducible_different_seed_differs(use_q):
    a = _sequence(7, use_q)
    b = _sequence(7, use_q)
    c = _sequence(8, use_q)
    assert a == b
    assert a != c


# ---- coupled verification (one generator per position) -------------------------------

def test_coupled_verification_follows_the_target_distribution_and_ignores_drafts():
    from scipy.stats import chisquare

    from specray.engine.verify import verify_sampled_coupled

    V = 5
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 2, dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    first = np.zeros(V)
    same_as_undrafted = 0
    draft_rng = np.random.default_rng(5)
    for t in range(n):
        d = np.array([draft_rng.integers(V)], dtype=np.int32)  # drafts from a very different q
        rngs = [np.random.default_rng((t, 0)), np.random.default_rng((t, 1))]
        n_acc, tok = verify_sampled_coupled(logits, d, params, rngs)
        emitted = int(d[0]) if n_acc == 1 else tok
        first[emitted] += 1
        # the same seed and position without any draft gives the same first token
        alone = verify_sampled_coupled(logits[:1], np.zeros(0, np.int32), params,
                                       [np.random.default_rng((t, 0))])
        same_as_undrafted += alone.next_token == emitted
    assert chisquare(first, p * n).pvalue > 0.001
    assert same_as_undrafted == n


def test_top2_margin_matches_a_full_partition_ties_included():
    from specray.engine.target import top2_margin

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((9, 4096)).astype(np.float32)
    rows[1, 10] = rows[1, 20] = rows[1].max() + 1.0  # a tie for the top: margin 0
    rows[2, 0] = rows[2].max() + 2.0  # the argmax at either end
    rows[3, -1] = rows[3].max() + 2.0
    part = np.partition(rows, -2, axis=1)[:, -2:]
    expected = part[:, 1] - part[:, 0]
    got = top2_margin(rows)
    assert got[1] == 0.0 and got[2] > 1.99 and got[3] > 1.99
    np.testing.assert_array_equal(got, expected)


def test_target_docstring_examples():
    import doctest

    from specray.engine import target

    failed, attempted = doctest.testmod(target)
    assert attempted > 0 and failed == 0
