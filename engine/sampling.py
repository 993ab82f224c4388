"""Target-side sampling: parameters, the llama.cpp-style sampler chain, draws.

The distribution the target samples from is built exactly as llama.cpp's
default sampler chain does it (the samplers this module supports, in order):

    penalties -> top_k -> top_p -> min_p -> temperature -> softmax -> draw

Notes on the llama.cpp semantics kept here:

* penalties: every *distinct* token of the last ``repeat_last_n`` tokens is
  penalised once: a positive logit is divided by ``repeat_penalty``, a logit
  <= 0 is multiplied by it.
* top_k / top_p / min_p act on the logits *before* temperature: top_p uses the
  softmax at temperature 1 over the candidates left by top_k; min_p keeps the
  tokens with ``logit >= max_logit + log(min_p)`` (``p >= min_p * p_max``).
  Each keeps at least one token.
* temperature 0 means greedy (argmax of the penalised logits). Greedy callers
  should not build a distribution at all: use ``np.argmax`` (see
  ``specray.engine.verify.verify_greedy``); ``target_probs`` still returns the
  matching one-hot distribution if called with temperature 0.

Everything is pure numpy; probabilities are float64 and uniforms are float64.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SamplingParams",
    "apply_repetition_penalty",
    "penalty_window",
    "target_probs",
    "sample_token",
    "make_rng",
]

# top_p without top_k: sort only this many best candidates first (as llama.cpp's
# adaptive partial sort); fall back to sorting every candidate if they do not
# reach top_p.
_TOP_P_FIRST_PASS = 256


class SamplingParams(BaseModel):
    """Per-request sampling parameters (llama.cpp / OpenAI style)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        default=0.0,
        ge=0.0,
        description="Softmax temperature, applied last; 0 = greedy (argmax).",
    )
    top_k: int = Field(
        default=0,
        ge=0,
        description="Keep only the k highest-logit tokens; 0 = off.",
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description=(
            "Nucleus sampling: keep the smallest set of best tokens whose "
            "probability (at temperature 1) sums to >= top_p; 1 = off."
        ),
    )
    min_p: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Drop tokens with probability < min_p * (best probability); 0 = off.",
    )
    repeat_penalty: float = Field(
        default=1.0,
        gt=0.0,
        description=(
            "Repetition penalty over the last repeat_last_n tokens: positive "
            "logits are divided by it, others multiplied; 1 = off."
        ),
    )
    repeat_last_n: int = Field(
        default=64,
        ge=0,
        description="How many most recent tokens the repetition penalty looks at; 0 = off.",
    )
    seed: int | None = Field(
        default=None,
        description="RNG seed for reproducible sampling; None = fresh entropy.",
    )

    @property
    def greedy(self) -> bool:
        """True if decoding is greedy (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def penalty_active(self) -> bool:
        """True if the repetition penalty changes anything."""
        return self.repeat_penalty != 1.0 and self.repeat_last_n > 0


def penalty_window(recent_tokens: np.ndarray | None, last_n: int) -> np.ndarray:
    """The last ``last_n`` tokens of ``recent_tokens`` (empty if none / last_n <= 0)."""
    if recent_tokens is None or last_n <= 0:
        return np.zeros(0, dtype=np.int64)
    recent = np.asarray(recent_tokens)
    return recent[-last_n:] if recent.shape[0] > last_n else recent


def apply_repetition_penalty(
    logits: np.ndarray, recent_tokens: np.ndarray | None, penalty: float
) -> np.ndarray:
    """Return a copy of ``logits`` (1-D, [V]) with llama.cpp's repeat penalty applied.

    Each distinct token id in ``recent_tokens`` (the caller passes the window,
    e.g. ``penalty_window(history, repeat_last_n)``) is penalised once: a
    logit > 0 is divided by ``penalty``, a logit <= 0 multiplied by it. Ids
    outside [0, V) are ignored. The arithmetic stays in the logits' dtype
    (float32 logits are scaled by a float32 penalty, as llama.cpp does).
    """
    out = np.array(logits, copy=True)
    if penalty == 1.0 or recent_tokens is None:
        return out
    toks = np.unique(np.asarray(recent_tokens).astype(np.int64, copy=False))
    if toks.size == 0:
        return out
    toks = toks[(toks >= 0) & (toks < out.shape[-1])]
    if toks.size == 0:
        return out
    pen = out.dtype.type(penalty) if np.issubdtype(out.dtype, np.floating) else penalty
    vals = out[toks]
    out[toks] = np.where(vals <= 0, vals * pen, vals / pen)
    return out


def _softmax64(x: np.ndarray) -> np.ndarray:
    """Numerically stable softmax in float64."""
    z = np.asarray(x, dtype=np.float64)
    z = z - z.max()
    np.exp(z, out=z)
    z /= z.sum()
    return z


def target_probs(
    logits_row: np.ndarray,
    params: SamplingParams,
    recent_tokens: np.ndarray | None = None,
) -> np.ndarray:
    """The distribution (float64, [V]) the target samples from for one logits row.

    ``recent_tokens`` is the sequence so far (prompt + generated, ending with
    the last token fed to the model); only its last ``params.repeat_last_n``
    tokens are used, for the repetition penalty.

    Pipeline (llama.cpp default chain): penalties -> top_k -> top_p -> min_p
    -> temperature -> softmax. Does only the work needed: no sort at all
    unless top_p < 1; top_k uses ``np.argpartition``; top_p sorts only the
    candidates left (first the best 256 when top_k is off).

    Greedy decoding (temperature 0) should not call this; if it does, the
    result is the one-hot distribution at the argmax of the penalised logits.
    """
    x = np.asarray(logits_row)
    if x.ndim != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {x.shape}")
    V = x.shape[0]
    if V == 0:
        raise ValueError("empty logits row")

    # 1. penalties
    if params.penalty_active:
        window = penalty_window(recent_tokens, params.repeat_last_n)
        if window.size:
            x = apply_repetition_penalty(x, window, params.repeat_penalty)

    if params.temperature == 0.0:
        out = np.zeros(V, dtype=np.float64)
        out[int(np.argmax(x))] = 1.0
        return out

    # Candidates: ``idx`` (token ids, None = all V in id order) and ``vals``
    # (their logits, same order).
    idx: np.ndarray | None = None
    vals = x

    # 2. top_k
    k = params.top_k
    if 0 < k < V:
        idx = np.argpartition(-x, k - 1)[:k]
        vals = x[idx]

    # 3. top_p (on softmax at temperature 1 of the candidates left)
    if params.top_p < 1.0 and vals.shape[0] > 1:
        n = vals.shape[0]
        v64 = np.asarray(vals, dtype=np.float64)
        m = v64.max()
        w = np.exp(v64 - m)
        total = w.sum()
        keep_pos = None  # positions in ``vals`` of the kept candidates, best first
        if n > 2 * _TOP_P_FIRST_PASS:
            first = np.argpartition(-v64, _TOP_P_FIRST_PASS - 1)[:_TOP_P_FIRST_PASS]
            first = first[np.argsort(-v64[first], kind="stable")]
            cum = np.cumsum(w[first]) / total
            cut = int(np.searchsorted(cum, params.top_p, side="left"))
            if cut < first.shape[0]:
                keep_pos = first[: cut + 1]
        if keep_pos is None:
            order = np.argsort(-v64, kind="stable")
            cum = np.cumsum(w[order]) / total
            cut = int(np.searchsorted(cum, params.top_p, side="left"))
            keep_pos = order[: cut + 1]  # cut == n (rounding) keeps everything
        idx = keep_pos if idx is None else idx[keep_pos]
        vals = vals[keep_pos]

    # 4. min_p (p >= min_p * p_max  <=>  logit >= max_logit + log(min_p))
    if params.min_p > 0.0 and vals.shape[0] > 1:
        v64 = np.asarray(vals, dtype=np.float64)
        keep = v64 >= v64.max() + np.log(params.min_p)
        if not keep.all():
            pos = np.flatnonzero(keep)
            idx = pos if idx is None else idx[pos]
            vals = vals[pos]

    # 5. temperature + softmax (float64)
    p = _softmax64(np.asarray(vals, dtype=np.float64) / params.temperature)
    if idx is None:
        return p
    out = np.zeros(V, dtype=np.float64)
    out[idx] = p
    return out


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from ``probs`` (inverse CDF with one float64 uniform).

    ``probs`` need not be exactly normalised (the CDF is scaled by its total).
    Tokens with probability 0 are never returned.
    """
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with zero total mass")
    u = rng.random()  # float64 in [0, 1)
    i = int(np.searchsorted(cdf, u * total, side="right"))
    if i >= cdf.shape[0] or probs[i] <= 0.0:
        # only reachable through rounding at the very top of the CDF
        i = int(np.flatnonzero(np.asarray(probs) > 0.0)[-1])
    return i


def make_rng(seed: int | None) -> np.random.Generator:
    """A numpy Generator seeded with ``seed`` (None = fresh OS entropy)."""
    return np.random.default_rng(seed)
