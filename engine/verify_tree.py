"""Verification of a draft tree (engine/draft_tree.py) against the target's rows, greedy and sampled.

The target decodes the root (the last committed token) and every node of the tree in one batch; row 0 is the
root's, row 1 + i node i's, each seeing only its ancestors. Verification walks down from the root: at each row
the target's own token is chosen exactly as token-by-token decoding would choose it there (greedy: the argmax
after bias, penalties over the path so far and a grammar; sampled: a draw from the target's distribution with
the generator of that position), and the walk goes on into the child holding that token. Where no child holds
it, that token is the next one. So the emitted tokens are those the target alone would emit, whatever the tree:
with one-hot drafts, taking the child that matches the target's own draw is the multi-candidate rejection
scheme (a child is accepted with probability p(child), the others are tried on the residual), coupled to the
position so that a seeded request gives the same tokens with or without speculation.

>>> import numpy as np
>>> from specray.engine.draft_tree import DraftTree
>>> rows = np.zeros((4, 10), np.float32)
>>> rows[0, 9] = rows[3, 2] = 1.0       # the target: 9 after the root, 2 after 9
>>> tree = DraftTree.build([5, 6], [(0, [9])])   # main 5 6, runner-up 9 at depth 0
>>> verify_tree_greedy(rows, tree)
TreeVerdict(path=[2], next_token=2, branch=1)
>>> verify_tree_greedy(rows[[0, 1, 2]], DraftTree.linear([5, 6]))   # the main draft alone keeps nothing
TreeVerdict(path=[], next_token=9, branch=0)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .constraint import TokenConstraint, constrained_argmax, constrained_row
from .draft_tree import DraftTree
from .sampling import SamplingParams, adjusted_logits, sample_token, target_probs

__all__ = ["TreeVerdict", "verify_tree_greedy", "verify_tree_sampled"]


class TreeVerdict(NamedTuple):
    path: list[int]  # the accepted nodes, root's child first
    next_token: int  # the target's token after the path
    branch: int  # the accepted path's branch (0: the main draft; draft_tree.DraftTree.leaves)

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def _check(rows: np.ndarray, tree: DraftTree) -> None:
    if rows.ndim != 2 or rows.shape[0] != len(tree) + 1:
        raise ValueError(f"rows must have shape [nodes + 1, V] = [{len(tree) + 1}, V], got {rows.shape}")
    if len(tree) and (int(tree.tokens.min()) < 0 or int(tree.tokens.max()) >= rows.shape[1]):
        raise ValueError(f"draft token ids must be in [0, {rows.shape[1]})")


def _walk(tree: DraftTree, choose) -> TreeVerdict:
    """Down from the root: `choose(row, depth, path_tokens)` gives the target's token at a row."""
    child_of = tree.child_of
    node, path, toks = -1, [], []
    while True:
        t = choose(node + 1, len(path), toks)
        nxt = child_of.get((node, t))
        if nxt is None:
            return TreeVerdict(path, t, tree.branch_of(node))
        node = nxt
        path.append(nxt)
        toks.append(t)


def verify_tree_greedy(rows: np.ndarray, tree: DraftTree, recent_tokens: np.ndarray | None = None,
                       params: SamplingParams | None = None, constraint: TokenConstraint | None = None,
                       masked: list | None = None) -> TreeVerdict:
    """Greedy verification of `tree`: the longest path whose every token is the target's argmax (with the logit
    bias, penalties over `recent_tokens` + the path before the row, and a grammar advanced by each emitted token,
    as engine/verify.verify_greedy), then the target's argmax after it. `masked` collects each decided row's
    masked logits where the grammar overrode the argmax (None where it did not)."""
    rows = np.asarray(rows)
    _check(rows, tree)
    adjust = params is not None and params.adjusts_logits
    recent = np.zeros(0, np.int64) if recent_tokens is None else np.asarray(recent_tokens, np.int64).reshape(-1)

    def choose(r: int, depth: int, toks: list[int]) -> int:
        row = rows[r]
        if adjust:
            window = None
            if params.penalty_active:
                hist = np.concatenate([recent, np.asarray(toks, np.int64)])
                window = hist[max(0, len(hist) - params.repeat_last_n):]
            row = adjusted_logits(row, params, window)
        if constraint is None:
            return int(row.argmax())
        t = constrained_argmax(row, constraint, masked)
        constraint.accept(t)
        return t

    return _walk(tree, choose)


def verify_tree_sampled(rows: np.ndarray, tree: DraftTree, params: SamplingParams, rngs: list[np.random.Generator],
                        recent_tokens: np.ndarray | None = None,
                        constraint: TokenConstraint | None = None) -> TreeVerdict:
    """Sampled verification of `tree`, coupled to the position (engine/verify.verify_sampled_coupled): the row
    at depth d draws the target's token with `rngs[d]` (the generator of that sequence position) from its
    distribution after the path; the walk goes into the child holding the draw. Every emitted token is a draw
    from the target's distribution given the tokens before it, so the output follows the target exactly."""
    if params.greedy:
        return verify_tree_greedy(rows, tree, recent_tokens, params, constraint)
    rows = np.asarray(rows)
    _check(rows, tree)
    depth = int(tree.depths.max()) + 2 if len(tree) else 1
    if len(rngs) < depth:
        raise ValueError(f"need {depth} generators, got {len(rngs)}")
    recent = np.zeros(0, np.int64) if recent_tokens is None else np.asarray(recent_tokens, np.int64).reshape(-1)
    last_n = params.repeat_last_n if params.penalty_active else 0

    def choose(r: int, d: int, toks: list[int]) -> int:
        row = rows[r] if constraint is None else constrained_row(rows[r], constraint)
        window = None
        if last_n:
            hist = np.concatenate([recent, np.asarray(toks, np.int64)])
            window = hist[max(0, len(hist) - last_n):]
        x = sample_token(target_probs(row, params, window), rngs[d])
        if constraint is not None:
            constraint.accept(x)
        return x

    return _walk(tree, choose)
