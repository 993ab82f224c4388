"""Target-side sampling: parameters, the llama.cpp-style sampler chain, draws.

The distribution the target samples from is built exactly as llama.cpp's
default sampler chain does it (the samplers this module supports, in order):

    logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> softmax -> draw

Notes on the llama.cpp semantics kept here:

* logit_bias: each listed token's bias is added to its logit, before anything
  else (llama.cpp's logit_bias sampler; OpenAI's ``logit_bias``).
* penalties: every *distinct* token of the last ``repeat_last_n`` tokens is
  penalised once: a positive logit is divided by ``repeat_penalty``, a logit
  <= 0 is multiplied by it; then ``count * frequency_penalty +
  presence_penalty`` is subtracted, count being its occurrences in the window
  (llama.cpp's penalties sampler; OpenAI's presence and frequency penalties,
  over llama.cpp's window rather than the whole text).
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
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "SamplingParams",
    "adjusted_logits",
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
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
        description="Subtracted once from the logit of each token found in the last repeat_last_n tokens; 0 = off.",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
        description="Subtracted from a token's logit once per time it occurs in the last repeat_last_n tokens; 0 = off.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> value added to its logit before every other step (-100 bans a token in practice).",
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=20,
        description=(
            "Report each emitted token's log-probability (log-softmax of the target's raw logits, as llama-server "
            "and vLLM report it) and this many most likely tokens with theirs; None = off."
        ),
    )
    prompt_logprobs: bool = Field(
        default=False,
        description=(
            "Also report the prompt tokens' log-probabilities (completions' echo): every prompt row outputs "
            "logits, and the prompt cache is not used for the request."
        ),
    )
    seed: int | None = Field(
        default=None,
        description="RNG seed for reproducible sampling; None = fresh entropy.",
    )
    grammar: str | None = Field(
        default=None,
        description=(
            "GBNF grammar the generated text must follow (llama.cpp's grammar sampler, as llama-server's "
            "`grammar`; response_format json_object / json_schema become one); None = free text."
        ),
    )

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _finite_bias(cls, v: dict[int, float]) -> dict[int, float]:
        if any(t < 0 for t in v) or not all(np.isfinite(list(v.values()))):
            raise ValueError("logit_bias maps token ids >= 0 to finite values")
        return v

    @property
    def greedy(self) -> bool:
        """True if decoding is greedy (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def penalty_active(self) -> bool:
        """True if the penalties (repeat, frequency, presence) change anything."""
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """True if the logits are changed before the candidates are picked (logit_bias or penalties)."""
        return bool(self.logit_bias) or self.penalty_active


def penalty_window(recent_tokens: np.ndarray | None, last_n: int) -> np.ndarray:
    """The last ``last_n`` tokens of ``recent_tokens`` (empty if none / last_n <= 0)."""
    if recent_tokens is None or last_n <= 0:
        return np.zeros(0, dtype=np.int64)
    recent = np.asarray(recent_tokens)
    return recent[-last_n:] if recent.shape[0] > last_n else recent


def apply_repetition_penalty(
    logits: np.ndarray, recent_tokens: np.ndarray | None, penalty: float, frequency: float = 0.0,
    presence: float = 0.0,
) -> np.ndarray:
    """Return a copy of ``logits`` (1-D, [V]) with llama.cpp's penalties applied.

    Each distinct token id in ``recent_tokens`` (the caller passes the window,
    e.g. ``penalty_window(history, repeat_last_n)``) is penalised once: a
    logit > 0 is divided by ``penalty``, a logit <= 0 multiplied by it; then
    ``count * frequency + presence`` is subtracted (count: its occurrences in
    the window). Ids outside [0, V) are ignored. The arithmetic stays in the
    logits' dtype (float32 logits, float32 factors, as llama.cpp does).

    >>> apply_repetition_penalty(np.array([2.0, -1.0, 3.0], dtype=np.float32), np.array([0, 0, 1]), 2.0, 0.5, 0.25)
    array([-0.25, -2.75,  3.  ], dtype=float32)
    """
    out = np.array(logits, copy=True)
    if (penalty == 1.0 and frequency == 0.0 and presence == 0.0) or recent_tokens is None:
        return out
    toks, counts = np.unique(np.asarray(recent_tokens).astype(np.int64, copy=False), return_counts=True)
    if toks.size == 0:
        return out
    inside = (toks >= 0) & (toks < out.shape[-1])
    toks, counts = toks[inside], counts[inside]
    if toks.size == 0:
        return out
    f = out.dtype.type if np.issubdtype(out.dtype, np.floating) else float
    vals = out[toks]
    if penalty != 1.0:
        vals = np.where(vals <= 0, vals * f(penalty), vals / f(penalty))
    if frequency != 0.0 or presence != 0.0:
        vals = vals - (counts.astype(vals.dtype) * f(frequency) + f(presence))
    out[toks] = vals
    return out


def adjusted_logits(logits: np.ndarray, params: SamplingParams, recent_tokens: np.ndarray | None) -> np.ndarray:
    """The logits the sampler chain picks candidates from: logit_bias added, then the penalties over the
    last ``repeat_last_n`` of ``recent_tokens``. 1-D [V] or 2-D [rows, V] (the same window for every row: the
    bias alone, as greedy verification batches it). Returns ``logits`` itself when nothing changes.

    >>> p = SamplingParams(logit_bias={2: -100.0}, presence_penalty=1.0)
    >>> adjusted_logits(np.array([1.0, 0.5, 3.0], dtype=np.float32), p, np.array([0]))
    array([  0. ,   0.5, -97. ], dtype=float32)
    """
    x = logits
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        vals = np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(params.logit_bias))
        inside = ids < x.shape[-1]
        x = np.array(x, copy=True)
        x[..., ids[inside]] += vals[inside].astype(x.dtype)
    if params.penalty_active and x.ndim == 1:
        window = penalty_window(recent_tokens, params.repeat_last_n)
        if window.size:
            x = apply_repetition_penalty(x, window, params.repeat_penalty, params.frequency_penalty,
                                         params.presence_penalty)
    return x


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

    # 1. logit_bias, penalties
    if params.adjusts_logits:
        x = adjusted_logits(x, params, recent_tokens)

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
