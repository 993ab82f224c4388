"""Constrained decoding: a per-sequence grammar state that says which tokens may come next.

The engine sees a grammar only through `TokenConstraint` (specray.native.grammar.Grammar implements it with
llama.cpp's grammar sampler) and builds one per sequence with a `ConstraintFactory` (GBNF text -> state).
Verification picks, at each row, the best token the grammar allows after the tokens before it
(`constrained_argmax`; sampled decoding masks the row first, `constrained_row`), and advances the state only
with the tokens it emits: a rejected draft token never reaches the grammar, so there is nothing to roll back.
Target-only decoding runs the same code with no draft, hence the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

__all__ = ["ConstraintError", "ConstraintFactory", "TokenConstraint", "constrained_argmax", "constrained_row"]


class ConstraintError(RuntimeError):
    """The grammar allows no token at all: the sequence cannot go on."""


class TokenConstraint(Protocol):
    def allows(self, token: int) -> bool: ...
    def allowed(self, tokens: np.ndarray) -> np.ndarray: ...  # bool per token
    def mask(self, logits: np.ndarray) -> np.ndarray: ...  # copy, forbidden tokens at -inf
    def accept(self, token: int) -> None: ...
    def clone(self) -> "TokenConstraint": ...
    def close(self) -> None: ...


#: GBNF text -> a fresh constraint state; raises ValueError if the grammar does not compile
ConstraintFactory = Callable[[str], TokenConstraint]


def constrained_row(row: np.ndarray, constraint: TokenConstraint) -> np.ndarray:
    """`row` with every token the constraint forbids at -inf; ConstraintError if it forbids them all."""
    masked = constraint.mask(row)
    if not np.isfinite(masked).any():
        raise ConstraintError("the grammar allows no token here (the vocabulary cannot continue it)")
    return masked


def constrained_argmax(row: np.ndarray, constraint: TokenConstraint, masked: list | None = None) -> int:
    """The highest-logit token the constraint allows (lowest id on ties, as np.argmax). The unconstrained argmax
    is tried first: where the grammar allows it (most rows), no full-vocabulary check is needed, which is
    llama.cpp's common_sampler shortcut, exact for greedy. `masked`: where the full check ran, the masked row
    is appended to it (else None): the choice's margin is over the allowed tokens only (the bench's tie check,
    TargetRunner.record_margins).

    >>> class Even:  # allows even token ids only
    ...     def allows(self, t): return t % 2 == 0
    ...     def mask(self, r): return np.where(np.arange(len(r)) % 2 == 0, r, -np.inf)
    >>> constrained_argmax(np.array([0.0, 3.0, 2.0, 1.0]), Even())
    2
    >>> constrained_argmax(np.array([5.0, 3.0, 2.0, 1.0]), Even())
    0
    """
    t = int(np.argmax(row))
    if constraint.allows(t):
        if masked is not None:
            masked.append(None)
        return t
    m = constrained_row(row, constraint)
    if masked is not None:
        masked.append(m)
    return int(np.argmax(m))
