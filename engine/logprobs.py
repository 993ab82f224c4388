"""Log-probabilities of emitted tokens, from the logits rows the verify already computed.

A verify decodes [last token + draft] and returns a logits row per position:
row i is the distribution the token at position i was chosen from, accepted
draft token or the target's own. So each emitted token's log-probability is
the log-softmax of its row at that token (no extra decode), the same number
target-only decoding would report for it. As llama-server and vLLM report
them by default, these are the model's raw distribution (temperature 1, no
penalties, bias or truncation), not the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLogprobs:
    """Per emitted token: its log-probability, and the `top_n` most likely tokens with theirs (best first)."""

    logprob: np.ndarray  # float64 [n]
    top_ids: np.ndarray  # int32 [n, top_n]
    top_logprobs: np.ndarray  # float64 [n, top_n]

    def __len__(self) -> int:
        return len(self.logprob)

    def head(self, n: int) -> "TokenLogprobs":
        """The first n tokens' entries (the tokens a sequence kept)."""
        return TokenLogprobs(self.logprob[:n], self.top_ids[:n], self.top_logprobs[:n])


def concat(chunks: list[TokenLogprobs]) -> TokenLogprobs:
    """Several rounds' TokenLogprobs as one."""
    return TokenLogprobs(np.concatenate([c.logprob for c in chunks]), np.concatenate([c.top_ids for c in chunks]),
                         np.concatenate([c.top_logprobs for c in chunks]))


def prompt_rows(n_tokens: int, pos0: int, n_prompt: int, sampled: bool) -> int:
    """Logits rows a prompt chunk of `n_tokens` at `pos0` outputs for the prompt's own logprobs (echo): each row
    predicts the next prompt token, so all of them but, in the prompt's last chunk, the last one (the row the
    first generated token is sampled from). 0 for rows past the prompt (a decode round's verify).

    >>> prompt_rows(4, 0, 10, sampled=False), prompt_rows(6, 4, 10, sampled=True), prompt_rows(3, 10, 10, True)
    (4, 5, 0)
    """
    if pos0 + n_tokens > n_prompt:
        return 0
    return n_tokens - 1 if sampled else n_tokens


def token_logprobs(rows: np.ndarray, tokens: np.ndarray, top_n: int) -> TokenLogprobs:
    """Log-softmax of each row (float64) at its token, and its top_n.

    >>> lp = token_logprobs(np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]], dtype=np.float32)),
    ...                     np.array([1, 2]), top_n=2)
    >>> np.round(np.exp(lp.logprob), 3).tolist(), lp.top_ids.tolist(), np.round(np.exp(lp.top_logprobs), 3).tolist()
    ([0.25, 0.7], [[0, 1], [2, 1]], [[0.5, 0.25], [0.7, 0.2]])
    """
    x = np.asarray(rows, dtype=np.float64)
    n = len(x)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    chosen = x[np.arange(n), np.asarray(tokens, dtype=np.int64)] - lse
    if top_n <= 0:
        return TokenLogprobs(chosen, np.zeros((n, 0), dtype=np.int32), np.zeros((n, 0)))
    top_n = min(top_n, x.shape[1])
    part = np.argpartition(-x, top_n - 1, axis=1)[:, :top_n]
    vals = np.take_along_axis(x, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    ids = np.take_along_axis(part, order, axis=1)
    return TokenLogprobs(chosen, ids.astype(np.int32), np.take_along_axis(vals, order, axis=1) - lse[:, None])
