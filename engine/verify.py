"""Verification of a draft against the target's logits (greedy and sampled).

The target decodes ``[last_token, d_0, ..., d_{k-1}]`` in one batch and returns
``k + 1`` logits rows: row ``i`` is the target's prediction for the position
of ``d_i`` (row ``k`` is the position after the whole draft). Verification
decides how many draft tokens to keep and which token comes next:

* ``verify_greedy``: keep ``d_i`` while it equals the argmax of row ``i``; the
  next token is the argmax of the first row not matched (the correction), or
  of row ``k`` (the bonus) if every draft token matched. Identical to plain
  greedy decoding, token for token.
* ``verify_sampled``: speculative rejection sampling (Leviathan et al. 2023,
  Chen et al. 2023; as vLLM's rejection sampler): accept ``d_i`` with
  probability ``min(1, p(d_i) / q(d_i))``; on rejection draw the next token
  from ``normalise(max(p - q, 0))``; if all are accepted draw a bonus token
  from row ``k``. The emitted tokens follow the target distribution exactly.
  Without draft probabilities ``q`` is one-hot at ``d_i`` (accept with
  probability ``p(d_i)``; the residual is ``p`` with ``p(d_i)`` zeroed,
  renormalised), which is lossless whatever way the draft was produced.

``recent_tokens`` is the sequence so far (prompt + generated, ending with the
last token fed to the target, i.e. the one row 0 is conditioned on). The
repetition penalty of row ``i`` looks at ``recent_tokens + d_0 .. d_{i-1}``,
exactly as token-by-token decoding would.

Both functions return a ``Verdict(n_accepted, next_token)``, a NamedTuple (so
it also unpacks as a plain ``(int, int)`` tuple). The tokens to emit are
``draft[:n_accepted]`` followed by ``next_token``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .constraint import TokenConstraint, constrained_argmax, constrained_row
from .sampling import (
    SamplingParams,
    adjusted_logits,
    sample_token,
    target_probs,
)

__all__ = ["Verdict", "verify_greedy", "verify_sampled"]


class Verdict(NamedTuple):
    """Outcome of verifying one draft."""

    n_accepted: int  # draft tokens kept (0..k)
    next_token: int  # correction (n_accepted < k) or bonus token (n_accepted == k)


def _check_inputs(logits: np.ndarray, draft: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    logits = np.asarray(logits)
    draft = np.asarray(draft).reshape(-1)
    k = draft.shape[0]
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"logits must have shape [k+1, V] = [{k + 1}, V], got {logits.shape}")
    V = logits.shape[1]
    if k and (min(ids := draft.tolist()) < 0 or max(ids) >= V):  # Python's min/max: 1-8 ids, numpy's took ~2 us
        raise ValueError(f"draft token ids must be in [0, {V})")
    return logits, draft, k, V


def _history(recent_tokens: np.ndarray | None, draft: np.ndarray) -> tuple[np.ndarray, int]:
    """recent_tokens + draft as one int64 array, and the length of recent_tokens."""
    if recent_tokens is None:
        recent = np.zeros(0, dtype=np.int64)
    else:
        recent = np.asarray(recent_tokens, dtype=np.int64).reshape(-1)
    return np.concatenate([recent, draft.astype(np.int64, copy=False)]), recent.shape[0]


def _window(hist: np.ndarray, end: int, last_n: int) -> np.ndarray:
    """The last ``last_n`` tokens of ``hist[:end]``."""
    return hist[max(0, end - last_n) : end]


def verify_greedy(
    logits: np.ndarray,
    draft: np.ndarray,
    recent_tokens: np.ndarray | None = None,
    params: SamplingParams | None = None,
    constraint: TokenConstraint | None = None,
    masked: list | None = None,
) -> Verdict:
    """Greedy verification: ``(n_accepted, next_token)``.

    ``logits`` is [k+1, V], ``draft`` [k] (k may be 0: the result is then
    ``(0, argmax(row 0))``). Row ``i``'s argmax is compared with ``draft[i]``
    up to the first mismatch. Only the logit bias and the penalties of
    ``params`` are used (temperature etc. are irrelevant to greedy); with a
    penalty, row ``i`` is penalised over ``recent_tokens + draft[:i]`` (last
    ``repeat_last_n``), so the result equals one-by-one greedy decoding with
    the same bias and penalties. Without a penalty this is one ``np.argmax`` over the block.
    Ties go to the lowest token id (as ``np.argmax`` and llama.cpp's greedy).

    With a ``constraint`` (a grammar, engine/constraint.py), row ``i``'s choice is the best token it allows
    after the tokens emitted before it, and it is advanced with every emitted token (rejected draft tokens
    never reach it), which is what constrained one-by-one decoding does; `masked` collects each decided row's
    masked logits where the grammar overrode the argmax (None where it did not).
    """
    if constraint is not None:
        return _verify_greedy_constrained(logits, draft, recent_tokens, params, constraint, masked)
    if len(draft) == 0 and (params is None or not params.adjusts_logits) and logits.ndim == 2 and len(logits) == 1:
        # most rounds' rows (plain decoding, sequences the planner sent no draft): one argmax, no checks to make
        return Verdict(0, int(logits[0].argmax()))
    logits, draft, k, _ = _check_inputs(logits, draft)

    if params is None or not params.adjusts_logits:
        # row by row, up to the first mismatch: a row after a rejected draft token is never read (each row is a
        # whole vocabulary, ~200 KB for SmolLM2, mostly out of the cache; np.argmax over the block read them all)
        for i, d in enumerate(draft.tolist()):
            t = int(logits[i].argmax())
            if t != d:
                return Verdict(i, t)
        return Verdict(k, int(logits[k].argmax()))
    if not params.penalty_active:
        # the bias is the same for every row: one add over the block
        am = np.argmax(adjusted_logits(logits, params, None), axis=1)
        mismatch = np.flatnonzero(am[:k] != draft)
        n = int(mismatch[0]) if mismatch.size else k
        return Verdict(n, int(am[n]))

    hist, n_recent = _history(recent_tokens, draft)
    last_n = params.repeat_last_n
    for i in range(k + 1):
        row = adjusted_logits(logits[i], params, _window(hist, n_recent + i, last_n))
        tok = int(np.argmax(row))
        if i == k or tok != int(draft[i]):
            return Verdict(i, tok)
    raise AssertionError("unreachable")  # pragma: no cover


def _verify_greedy_constrained(logits: np.ndarray, draft: np.ndarray, recent_tokens: np.ndarray | None,
                               params: SamplingParams | None, constraint: TokenConstraint,
                               masked: list | None = None) -> Verdict:
    """verify_greedy under a grammar: row by row, the grammar advanced by each emitted token."""
    logits, draft, k, _ = _check_inputs(logits, draft)
    adjust = params is not None and params.adjusts_logits
    hist, n_recent = _history(recent_tokens, draft) if adjust and params.penalty_active else (None, 0)
    for i in range(k + 1):
        row = logits[i]
        if adjust:
            row = adjusted_logits(row, params, None if hist is None else
                                  _window(hist, n_recent + i, params.repeat_last_n))
        tok = constrained_argmax(row, constraint, masked)
        constraint.accept(tok)
        if i == k or tok != int(draft[i]):
            return Verdict(i, tok)
    raise AssertionError("unreachable")  # pragma: no cover


def verify_sampled(
    logits: np.ndarray,
    draft: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent_tokens: np.ndarray | None = None,
    draft_probs: np.ndarray | None = None,
) -> Verdict:
    """Rejection-sampling verification: ``(n_accepted, next_token)``.

    ``logits`` [k+1, V]; ``draft`` [k]; ``draft_probs`` [k, V] (the draft's
    own distribution each token was drawn from) or None (treated as one-hot
    at each draft token). For row ``i``, ``p = target_probs(row i, params,
    recent_tokens + draft[:i])``; ``d_i`` is accepted if ``u < p(d_i) /
    q(d_i)`` for a float64 uniform ``u`` from ``rng``; on rejection the next
    token is drawn from ``normalise(max(p - q, 0))`` (``p`` if that residual
    has no mass). If all k are accepted the bonus is drawn from row ``k``.

    A draft token with ``q(d_i) == 0`` cannot have been drawn from ``q``;
    rather than divide by zero it is verified as if ``q`` were one-hot (the
    caller's ``draft_probs`` are wrong in that case).

    The RNG is consumed in a fixed order (one uniform per draft position
    tested, one per final draw), so a seeded ``rng`` makes the result
    reproducible. With ``params.greedy`` (temperature 0) this is
    ``verify_greedy`` and draws nothing from ``rng``.
    """
    if params.greedy:
        return verify_greedy(logits, draft, recent_tokens, params)
    logits, draft, k, V = _check_inputs(logits, draft)
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
        if draft_probs.shape != (k, V):
            raise ValueError(f"draft_probs must have shape [k, V] = [{k}, {V}], got {draft_probs.shape}")

    hist = None
    if params.penalty_active:
        hist, n_recent = _history(recent_tokens, draft)

    def window(i: int) -> np.ndarray | None:
        """Penalty window of row i: recent_tokens + draft[:i] (last repeat_last_n)."""
        return None if hist is None else _window(hist, n_recent + i, params.repeat_last_n)

    for i in range(k):
        p = target_probs(logits[i], params, window(i))
        d = int(draft[i])
        q = None if draft_probs is None else np.asarray(draft_probs[i], dtype=np.float64)
        if q is not None and not q[d] > 0.0:
            q = None  # d could not come from q: verify it as one-hot
        p_d = p[d]
        ratio = p_d if q is None else p_d / q[d]
        u = rng.random()
        if u < ratio:
            continue
        # rejected: draw from the residual normalise(max(p - q, 0))
        if q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        if not residual.sum() > 0.0:
            residual = p  # degenerate (only through rounding): fall back to p
        return Verdict(i, sample_token(residual, rng))

    p = target_probs(logits[k], params, window(k))
    return Verdict(k, sample_token(p, rng))


def verify_sampled_coupled(
    logits: np.ndarray,
    draft: np.ndarray,
    params: SamplingParams,
    rngs: "list[np.random.Generator]",
    recent_tokens: np.ndarray | None = None,
    constraint: TokenConstraint | None = None,
) -> Verdict:
    """Rejection sampling for deterministic (one-hot q) drafters, coupled to the position.

    Row ``i`` draws the target's token ``x_i ~ p_i`` with its own generator
    ``rngs[i]`` (one per sequence position, derived from the request seed);
    the draft token is accepted iff ``x_i == draft[i]``, else ``x_i`` is the
    correction. For one-hot q this is exactly the min(1, p/q) rule:
    P(accept d) = p(d), and a rejected row yields p restricted to tokens != d,
    renormalised, i.e. normalise(max(p - q, 0)). Because each position's
    draw depends only on (seed, position, logits), a seeded request gives the
    same tokens whatever the speculators propose, with or without speculation
    (in exact mode bit for bit). This is also what llama.cpp's verify does.

    With a ``constraint`` each row is masked by the grammar (after the tokens emitted before it) before the
    sampler chain: the target samples from its distribution restricted to what the grammar allows.
    """
    if params.greedy:
        return verify_greedy(logits, draft, recent_tokens, params, constraint)
    logits, draft, k, _ = _check_inputs(logits, draft)
    if len(rngs) < k + 1:
        raise ValueError(f"need {k + 1} generators, got {len(rngs)}")
    hist, n_recent = _history(recent_tokens, draft)
    last_n = params.repeat_last_n if params.penalty_active else 0
    for i in range(k + 1):
        row = logits[i] if constraint is None else constrained_row(logits[i], constraint)
        p = target_probs(row, params, _window(hist, n_recent + i, last_n))
        x = sample_token(p, rngs[i])
        if constraint is not None:
            constraint.accept(x)
        if i == k or x != int(draft[i]):
            return Verdict(i, x)
    raise AssertionError("unreachable")  # pragma: no cover
