"""ngram_simple: draft what followed the most recent earlier occurrence of the last n tokens.

Mirrors llama.cpp's `common_ngram_simple_draft` (common/ngram-map.cpp). In
llama.cpp terms `tokens = history[:-1]` and `sampled = history[-1]`; the key is
the last n-1 tokens plus the sampled one, i.e. the last `size_n` tokens of
`history`. Stateless: every call scans the history again (in C, through
`bytes.rfind` over the int32 buffer), so there is no per-sequence state.

llama.cpp quirks kept on purpose (so drafts are the same as llama-server's):

* no draft unless `len(tokens) > size_n + size_m + 1`;
* position 0 is never a match (llama.cpp uses 0 as "no match");
* the continuation is copied from `tokens` only (never includes the last
  sampled token);
* only the most recent match is considered, and if fewer than `size_n` tokens
  follow it the result is empty (no fallback to an older match). A loop whose
  period is <= size_n therefore drafts nothing.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, as_tokens


class NgramSimpleParams(BaseModel):
    """Parameters of ngram_simple (llama.cpp `--spec-ngram-size-n/-m` defaults)."""

    model_config = ConfigDict(extra="forbid")

    size_n: int = Field(12, ge=1, le=1024, description="key length: the last size_n tokens of the history")
    size_m: int = Field(48, ge=1, le=1024, description="at most this many tokens that followed the match are drafted")


def ngram_simple_draft(history: np.ndarray, size_n: int = 12, size_m: int = 48) -> np.ndarray:
    """Draft for `history` (prompt + generated, ending with the last sampled token).

    Finds the most recent earlier start j >= 1 of the last `size_n` tokens with
    the n-gram ending before the final token, and returns up to `size_m` of the
    tokens after it (never including the final token). Empty if there is no
    match or fewer than `size_n` tokens follow the match.

    >>> h = np.array([0, 1, 2, 3, 4, 5, 6, 9, 1, 2], np.int32)
    >>> ngram_simple_draft(h, size_n=2, size_m=4)    # [1 2] at j=1 -> 3 4 5 6
    array([3, 4, 5, 6], dtype=int32)
    >>> ngram_simple_draft(h, size_n=2, size_m=6)    # len(tokens)=9 <= 2+6+1: too short
    array([], dtype=int32)
    >>> h = np.array([0, 7, 1, 2, 3, 4, 5, 1, 2, 8, 9, 6, 1, 2], np.int32)
    >>> ngram_simple_draft(h, size_n=2, size_m=3)    # most recent [1 2] is at j=7
    array([8, 9, 6], dtype=int32)
    """
    h = as_tokens(history)
    n, m = int(size_n), int(size_m)
    cur_len = len(h) - 1  # llama.cpp's `tokens` = history[:-1]
    if n <= 0 or cur_len <= n + m + 1:
        return EMPTY_DRAFT
    hb = h.tobytes()
    isz = h.itemsize
    pat = hb[(len(h) - n) * isz :]
    # candidates j in [1, cur_len - n - 1]: the n-gram lies in bytes [isz, isz*(cur_len-1))
    end = (cur_len - 1) * isz
    while True:
        p = hb.rfind(pat, isz, end)
        if p < 0:
            return EMPTY_DRAFT
        if p % isz == 0:
            break
        end = p + len(pat) - 1  # unaligned hit: look for matches starting before it
    j = p // isz
    copy_max = min(m, cur_len - (j + n))
    if copy_max < n:
        return EMPTY_DRAFT
    return h[j + n : j + n + copy_max].copy()


class NgramSimpleSpeculator(Speculator):
    """Stateless prompt-lookup speculator (llama.cpp `ngram-simple`)."""

    name = "ngram_simple"

    def __init__(self, params: NgramSimpleParams | None = None) -> None:
        super().__init__()
        self.params = params or NgramSimpleParams()

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        return ngram_simple_draft(req.history, self.params.size_n, self.params.size_m)
