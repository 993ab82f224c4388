"""Token prefixes held under keys, in a radix tree: which held prefix a prompt shares most with, in one walk.

The prompt cache's host tier holds many saved prefixes (a conversation each, many under a large
`--cache-ram`), and every admission and every queue ordering asks which of them shares the longest prefix
with a prompt. Compared one by one that is a scan of every entry's tokens per question. As in SGLang's
RadixAttention, the held prefixes are kept in one tree instead: an edge holds a run of tokens, so a shared
system prompt is one edge that every conversation's entry hangs below, and a question walks one path from
the root, comparing each edge as a numpy slice.

A key's tokens end at a node (`keys`). A node exists only while some key ends at or below it; removing a key
prunes what nothing holds any more and merges a node left with one child and no key into that child, so the
tree stays compressed. Each node remembers the key below it that holds the fewest tokens, so the answer for a
prompt that leaves the tree at a node with many conversations below it (a new conversation after the shared
system prompt) needs no walk of them.

>>> idx = RadixIndex()
>>> idx.insert("a", np.array([1, 2, 3, 4])); idx.insert("b", np.array([1, 2, 3, 9, 9]))
>>> idx.insert("c", np.array([1, 2]))
>>> idx.longest(np.array([1, 2, 3, 4, 5]))        # "a" shares 4 tokens
('a', 4)
>>> idx.longest(np.array([1, 2, 3, 7]))           # "a" and "b" share 3: the one with fewer tokens
('a', 3)
>>> idx.prefixes_of(np.array([1, 2, 3, 4, 5])), idx.covers(np.array([1, 2, 3, 9])), idx.covers(np.array([5]))
(['c', 'a'], True, False)
>>> idx.remove("a"); idx.longest(np.array([1, 2, 3, 4]))
('b', 3)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class _Node:
    __slots__ = ("edge", "parent", "children", "keys", "depth", "best")

    def __init__(self, edge: np.ndarray, parent: _Node | None, depth: int) -> None:
        self.edge = edge  # the tokens from the parent to here
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first token of the child's edge
        self.keys: set[Hashable] = set()  # keys whose tokens end here
        self.depth = depth  # tokens from the root to here
        # the key at or below here holding the fewest tokens, then the smallest: (depth, order, key), or None
        self.best: tuple | None = None

    def refresh(self) -> None:
        """Recompute `best` from this node's own keys and its children's."""
        own = [(self.depth, _order(k), k) for k in self.keys]
        self.best = min([*own, *(c.best for c in self.children.values() if c.best is not None)], default=None)


class RadixIndex:
    """Keys mapped to token sequences, with longest-shared-prefix questions answered by one walk (module
    docstring). Keys are any hashable; a key inserted again replaces its tokens."""

    def __init__(self) -> None:
        self._root = _Node(np.empty(0, dtype=np.int32), None, 0)
        self._where: dict[Hashable, _Node] = {}  # key -> the node its tokens end at

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def tokens(self, key: Hashable) -> np.ndarray:
        """The tokens `key` holds (KeyError if it holds none)."""
        node, parts = self._where[key], []
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=np.int32)

    def insert(self, key: Hashable, tokens: np.ndarray) -> None:
        """Hold `tokens` under `key` (replacing what it held)."""
        if key in self._where:
            self.remove(key)
        tokens = np.asarray(tokens, dtype=np.int32)
        node, at = self._root, 0
        while at < len(tokens):
            child = node.children.get(int(tokens[at]))
            if child is None:
                leaf = _Node(tokens[at:].copy(), node, len(tokens))
                node.children[int(tokens[at])] = leaf
                node, at = leaf, len(tokens)
                break
            m = _common(child.edge, tokens[at:])
            if m < len(child.edge):  # the path leaves this edge part way: split it there
                child = self._split(child, m)
            node, at = child, at + m
        node.keys.add(key)
        self._where[key] = node
        rank = (node.depth, _order(key), key)
        while node is not None and (node.best is None or rank < node.best):
            node.best = rank
            node = node.parent

    def remove(self, key: Hashable) -> None:
        """Forget `key` (nothing if it holds nothing); prunes and merges what it leaves."""
        node = self._where.pop(key, None)
        if node is None:
            return
        node.keys.discard(key)
        while node is not self._root and not node.keys and not node.children:
            parent = node.parent
            del parent.children[int(node.edge[0])]
            node = parent
        if node is not self._root and not node.keys and len(node.children) == 1:
            node = self._merge(node)
        while node is not None:
            node.refresh()
            node = node.parent

    def longest(self, prompt: np.ndarray) -> tuple[Hashable | None, int]:
        """(key, n): a key sharing the longest prefix with `prompt`, n tokens of it; of those sharing n, the one
        holding the fewest tokens (the cheapest to restore), then the smallest key. (None, 0) where none shares
        a token. To cap n at `limit`, ask with `prompt[:limit]`."""
        node, at, prompt = self._root, 0, np.asarray(prompt)
        while at < len(prompt):
            child = node.children.get(int(prompt[at]))
            if child is None:
                break
            m = _common(child.edge, prompt[at:])
            at += m
            node = child
            if m < len(child.edge):
                break
        if at == 0:
            return None, 0
        return node.best[2], at

    def prefixes_of(self, tokens: np.ndarray) -> list[Hashable]:
        """The keys whose tokens are a prefix of `tokens` (equal included), shortest first."""
        out: list[Hashable] = []
        node, at, tokens = self._root, 0, np.asarray(tokens)
        out.extend(sorted(node.keys, key=_order))
        while at < len(tokens):
            child = node.children.get(int(tokens[at]))
            fits = child is not None and len(child.edge) <= len(tokens) - at
            if not fits or _common(child.edge, tokens[at:]) < len(child.edge):
                break
            node, at = child, at + len(child.edge)
            out.extend(sorted(node.keys, key=_order))
        return out

    def covers(self, tokens: np.ndarray) -> bool:
        """Whether some key holds all of `tokens` (they are a prefix of its tokens)."""
        node, at, tokens = self._root, 0, np.asarray(tokens)
        while at < len(tokens):
            child = node.children.get(int(tokens[at]))
            if child is None:
                return False
            m = _common(child.edge, tokens[at:])
            if m < len(child.edge) and at + m < len(tokens):
                return False
            node, at = child, at + m
        return node is not self._root or bool(self._where)  # a node stands only while some key holds it

    def nodes(self) -> int:
        """Nodes in the tree, the root included (a measure of how much the held prefixes share)."""
        return sum(1 for _ in self._walk(self._root))

    # ---- inside -----------------------------------------------------------------------------------
    def _split(self, child: _Node, m: int) -> _Node:
        """Cut `child`'s edge after m tokens: a new node there, `child` below it. Returns the new node."""
        parent = child.parent
        mid = _Node(child.edge[:m], parent, child.depth - len(child.edge) + m)
        mid.best = child.best
        parent.children[int(child.edge[0])] = mid
        child.edge = child.edge[m:]
        child.parent = mid
        mid.children[int(child.edge[0])] = child
        return mid

    def _merge(self, node: _Node) -> _Node:
        """`node` holds no key and has one child: the child takes its place, edges joined. Returns the child."""
        (child,) = node.children.values()
        parent = node.parent
        child.edge = np.concatenate([node.edge, child.edge])
        child.parent = parent
        parent.children[int(child.edge[0])] = child
        return child

    @staticmethod
    def _walk(node: _Node) -> Iterator[_Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _order(key: Hashable) -> tuple:
    """A total order over keys of mixed types (ties broken by the smallest key)."""
    return (type(key).__name__, key) if isinstance(key, (int, str, float)) else (type(key).__name__, repr(key))
