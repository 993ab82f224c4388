"""Small helpers shared by the model-free speculators (no model, no llama.cpp)."""

from __future__ import annotations

import numpy as np

from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE

__all__ = ["EMPTY_DRAFT", "TOKEN_DTYPE", "as_tokens", "HistoryCursor"]


def as_tokens(x) -> np.ndarray:
    """Any int sequence -> contiguous int32 array (no copy if it already is one)."""
    return np.ascontiguousarray(x, dtype=TOKEN_DTYPE)


class HistoryCursor:
    """How much of one sequence's history a stateful speculator has indexed.

    Between two calls a sequence's history only grows by appending. The cursor
    remembers the length seen last time plus the first and the last token seen,
    and `is_extension(h)` checks cheaply (O(1)) that `h` still starts with what
    was indexed. It is False when the history got shorter or a seq_id was
    reused for another sequence: the caller then rebuilds its state.

    >>> c = HistoryCursor()
    >>> c.is_extension(np.array([5, 6, 7], np.int32))
    True
    >>> c.advance(np.array([5, 6, 7], np.int32)); c.n
    3
    >>> c.is_extension(np.array([5, 6, 7, 8], np.int32))
    True
    >>> c.is_extension(np.array([5, 6], np.int32)), c.is_extension(np.array([5, 9, 9, 9], np.int32))
    (False, False)
    """

    __slots__ = ("n", "first", "last")

    def __init__(self) -> None:
        self.n = 0
        self.first = -1
        self.last = -1

    def is_extension(self, h: np.ndarray) -> bool:
        n = self.n
        if n == 0:
            return True
        if len(h) < n:
            return False
        return int(h[0]) == self.first and int(h[n - 1]) == self.last

    def advance(self, h: np.ndarray) -> None:
        self.n = len(h)
        if self.n:
            self.first = int(h[0])
            self.last = int(h[-1])

    def reset(self) -> None:
        self.n = 0
        self.first = self.last = -1
