"""A token tree drafted for one sequence: a main draft and runner-up branches off it.

A linear draft guesses one continuation; where a speculator holds several (a suffix tree's children, an n-gram's
ranked values) the runner-ups can ride along in the same verify. A `DraftTree` is the main draft `d_0 .. d_{k-1}`
(nodes 0..k-1, node i the child of node i-1) plus branches: each diverges from the main draft at depth `at`
(its first token is a sibling of `d_at`, a child of `d_{at-1}` or of the root, the last committed token) and
continues on its own path. Nodes are in topological order (a parent before its children).

The target verifies the tree in one decode: every node is a row at its depth's position; a row sees the
committed context and its own ancestors. Each branch (a root-to-leaf path) is one sequence id in llama.cpp's
unified KV cache, and a node on several branches is one row carrying all their ids (`row_branches`).

>>> t = DraftTree.build([5, 6, 7], [(0, [9, 4]), (2, [8])])
>>> t.tokens.tolist(), t.parents.tolist()
([5, 6, 7, 9, 4, 8], [-1, 0, 1, -1, 3, 1])
>>> t.depths.tolist(), t.n_main, t.n_branches
([0, 1, 2, 0, 1, 2], 3, 3)
>>> [t.path(n) for n in (2, 4, 5)]
[[0, 1, 2], [3, 4], [0, 1, 5]]
>>> t.row_branches()     # root row, then each node: the branches (0 = main) it lies on
[[0, 1, 2], [0, 2], [0, 2], [0], [1], [1], [2]]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Branch:
    """A runner-up continuation a speculator holds beside its draft: it replaces the draft's token at depth `at`
    and goes on with `tokens[1:]`. `weight`: the speculator's own estimate of how likely its first token is
    against the draft's token there (its count over the draft's, in (0, 1]); the policy calibrates it."""

    at: int
    tokens: np.ndarray
    weight: float


def runner_ups_within(last: np.ndarray | None, held: list[Branch], main: list[int], width: int) -> list[Branch]:
    """The runner-ups `held` beside a speculator's last draft `last` that start within `main` (a prefix of that
    draft, as the planner cut it), most likely first, at most `width`; none where `main` is not a prefix of it.

    >>> held = [Branch(0, np.array([9]), 0.2), Branch(2, np.array([8]), 0.9), Branch(1, np.array([7]), 0.5)]
    >>> [b.at for b in runner_ups_within(np.array([5, 6, 4]), held, [5, 6], 3)]
    [1, 0]
    >>> runner_ups_within(np.array([5, 6, 4]), held, [5, 3], 3)
    []
    """
    if last is None or main != last[: len(main)].tolist():
        return []
    return sorted((b for b in held if b.at < len(main)), key=lambda b: -b.weight)[:width]


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n]: a node's parent index, -1 for a child of the root
    n_main: int  # nodes 0..n_main-1 are the main draft

    @classmethod
    def build(cls, main, branches) -> "DraftTree":
        """The main draft and branches given as (at, tokens) or `Branch`. A branch that starts past the main
        draft's end, repeats a token already drafted at its place, or is empty, is dropped."""
        main = np.asarray(main, dtype=np.int32).reshape(-1)
        k = len(main)
        toks, parents = main.tolist(), list(range(-1, k - 1))
        taken = {(i - 1, t) for i, t in enumerate(toks)}  # (parent, token) pairs already in the tree
        for b in branches:
            at, btoks = (b.at, b.tokens) if isinstance(b, Branch) else b
            btoks = [int(x) for x in np.asarray(btoks).reshape(-1)]
            if not btoks or at < 0 or at >= k or (at - 1, btoks[0]) in taken:
                continue
            parent = at - 1
            for j, t in enumerate(btoks):
                taken.add((parent, t))
                toks.append(t)
                parents.append(parent)
                parent = len(toks) - 1
        return cls(np.asarray(toks, dtype=np.int32), np.asarray(parents, dtype=np.int32), k)

    @classmethod
    def linear(cls, tokens) -> "DraftTree":
        return cls.build(tokens, ())

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> np.ndarray:
        """Each node's depth (0: a child of the root); the node's KV position is the root's + 1 + depth."""
        d = np.zeros(len(self), dtype=np.int32)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 0 if p < 0 else d[p] + 1
        return d

    @cached_property
    def leaves(self) -> list[int]:
        """The branches' last nodes: the main draft's first (branch 0), then each branch's in order."""
        has_child = set(self.parents.tolist())
        main_leaf = [self.n_main - 1] if self.n_main else []
        return main_leaf + [i for i in range(self.n_main, len(self)) if i not in has_child]

    @property
    def n_branches(self) -> int:
        return len(self.leaves)

    @property
    def is_linear(self) -> bool:
        return len(self) == self.n_main

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node` (empty for node -1, the root)."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def row_branches(self) -> list[list[int]]:
        """For the root row and then each node's row: the branches (indices into `leaves`) whose path holds it."""
        rows: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for b, leaf in enumerate(self.leaves):
            rows[0].append(b)
            for n in self.path(leaf):
                rows[n + 1].append(b)
        return rows

    def branch_of(self, node: int) -> int:
        """The first branch whose path holds `node` (0 for the root)."""
        if node < 0:
            return 0
        for b, leaf in enumerate(self.leaves):
            n = leaf
            while n >= 0:
                if n == node:
                    return b
                if n < node:
                    break
                n = int(self.parents[n])
        raise ValueError(f"node {node} is on no branch")

    @cached_property
    def child_of(self) -> dict[tuple[int, int], int]:
        """(parent, token) -> node."""
        return {(int(p), int(t)): i for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist()))}
