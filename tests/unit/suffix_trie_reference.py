"""The suffix trie as it was with one Python object per node (engine/speculators/suffix.py before its nodes moved
into flat lists): the reference tests/unit/test_spec_suffix.py holds SuffixTrie's counts, walks and runner-ups
equal to, operation by operation. Kept as it was; not used by the engine."""

from __future__ import annotations

import numpy as np

from specray.engine.draft_tree import Branch

_SHIFT = 32
_POS = (1 << _SHIFT) - 1

class _Node:
    """Explicit trie node: the number of occurrences of its string, and its children.

    A child is a _Node, or a leaf: an int ``sid << 32 | pos`` meaning the
    string continues with seqs[sid][pos] and occurs only there; below it the
    path follows the sequence (count 1 at every depth) until max_depth or the
    sequence end. A node with one child keeps it in `one` (token = `best`);
    from two children on they live in the dict `kids`. `bestc == -1` marks a
    stale best child (after a removal): `fresh()` rescans before it is read, so
    removals never scan wide nodes (the root has a child per vocabulary token).
    """

    __slots__ = ("count", "best", "bestc", "one", "kids")

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.best = -1  # token of the most frequent child (first to reach the top count)
        self.bestc = 0  # its count
        self.one = None  # the only child, while kids is None
        self.kids: dict | None = None

    def child(self, t: int):
        kids = self.kids
        if kids is None:
            return self.one if self.best == t else None
        return kids.get(t)

    def items(self) -> list:
        if self.kids is not None:
            return list(self.kids.items())
        return [] if self.one is None else [(self.best, self.one)]

    def put_new(self, t: int, ch, c: int) -> None:
        """Add child t (not a child yet) with count c."""
        kids = self.kids
        if kids is None:
            if self.one is None:
                self.one, self.best, self.bestc = ch, t, c
                return
            self.kids = kids = {self.best: self.one}
            self.one = None
        kids[t] = ch
        if c > self.bestc >= 0:
            self.best, self.bestc = t, c

    def replace(self, t: int, ch) -> None:
        if self.kids is None:
            self.one = ch
        else:
            self.kids[t] = ch

    def drop(self, t: int) -> None:
        kids = self.kids
        if kids is None:
            self.one, self.best, self.bestc = None, -1, 0
            return
        del kids[t]
        if len(kids) == 1:
            ((tt, cc),) = kids.items()
            self.kids, self.one, self.best, self.bestc = None, cc, tt, _count(cc)
        elif self.best == t:
            self.bestc = -1  # stale (dict nodes only read best after fresh())

    def fresh(self) -> "_Node":
        if self.bestc < 0:
            self.rescan()
        return self

    def rescan(self) -> None:
        """Recompute the best child (after counts went down)."""
        items = self.items()  # before best is reset: a lone child is keyed by it
        self.best, self.bestc = -1, 0
        for t, ch in items:
            c = _count(ch)
            if c > self.bestc:
                self.best, self.bestc = t, c


def _count(obj) -> int:
    return obj.count if type(obj) is _Node else 1


class ObjectSuffixTrie:
    """Depth-bounded trie of all suffixes of one or more token sequences.

    >>> t = SuffixTrie(max_depth=8)
    >>> t.extend(0, [1, 2, 3, 1, 2, 4, 1, 2])
    >>> t.count([1, 2]), t.count([1, 2, 3]), t.count([2, 4, 1]), t.count([3, 3])
    (3, 1, 1, 0)
    >>> [k for k, s in t.active_states(0)]      # suffixes ending the sequence that occur twice+
    [1, 2]
    >>> k, s = t.active_states(0)[1]             # "1 2": followed by 3 once, 4 once, (end) once
    >>> toks, probs = t.walk(k, s, budget=4, p_min=0.0); toks, [round(p, 3) for p in probs]
    ([3, 1, 2, 4], [0.333, 0.333, 0.333, 0.333])
    >>> t.walk(k, s, budget=4, p_min=0.5)        # 1/3 < p_min: nothing
    ([], [])
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = int(max_depth)
        self.root = _Node()
        self.seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}
        self.n_tokens = 0
        self.version = 0  # bumped by owners when matching states must be recomputed

    # ---- building ----------------------------------------------------------
    def extend(self, sid: int, tokens) -> None:
        """Append tokens to sequence `sid` (created if new), inserting every new suffix.

        The suffixes ending at the last token that occur more than once are
        explicit nodes and have contiguous lengths 1..K (a suffix of a repeated
        string is repeated): they are kept as a list by length, and each new
        token extends them shortest first (O(K) per token).
        """
        seq = self.seqs.setdefault(sid, [])
        act = self._active.get(sid, [])  # act[i]: node of the suffix of length i + 1
        D = self.max_depth
        root = self.root
        seqs = self.seqs
        actives = self._active
        Node = _Node
        base = sid << _SHIFT
        for t in tokens:
            t = int(t)
            cur = len(seq)
            seq.append(t)
            root.count += 1
            new: list[_Node] = []
            node = root
            i = 0  # act index of the next node; `node` has depth i
            n_act = len(act)
            while True:
                kids = node.kids
                if kids is None:
                    ch = node.one if node.best == t else None
                else:
                    ch = kids.get(t)
                if ch is None:
                    # the string is new here, hence also for every longer suffix
                    leaf = base | cur
                    while True:
                        node.put_new(t, leaf, 1)
                        if i >= n_act:
                            break
                        node = act[i]
                        i += 1
                    break
                if type(ch) is Node:
                    c = ch.count = ch.count + 1
                else:  # split a leaf: its occurrence and ours
                    q = ch & _POS
                    sid2 = ch >> _SHIFT
                    seq2 = seqs[sid2]
                    m = Node(2)
                    if q + 1 < len(seq2):
                        if i + 2 <= D:
                            m.one, m.best, m.bestc = ch + 1, seq2[q + 1], 1
                    elif sid2 in actives and i + 1 < D:
                        # the leaf was the growing end of another (unfinished) sequence:
                        # that suffix is now explicit and must grow with its sequence
                        act2 = actives[sid2]
                        if len(act2) == i:
                            act2.append(m)
                    if kids is None:
                        node.one = m
                    else:
                        kids[t] = m
                    ch = m
                    c = 2
                bc = node.bestc
                if c > bc:
                    if bc < 0:
                        node.rescan()
                    else:
                        node.best, node.bestc = t, c
                new.append(ch)
                if i >= n_act:
                    break
                node = act[i]
                i += 1
            if len(new) >= D:
                del new[D - 1 :]  # depth-D nodes cannot grow
            act = new
        self._active[sid] = act
        self.n_tokens += len(tokens)

    def finish(self, sid: int) -> None:
        """No more tokens for `sid`: drop its growing-suffix list."""
        self._active.pop(sid, None)

    def remove_range(self, sid: int, start: int, stop: int) -> None:
        """Take the suffixes of `sid` starting in [start, stop) out of the counts."""
        seq = self.seqs[sid]
        D = self.max_depth
        L = len(seq)
        root = self.root
        for s in range(start, min(stop, L)):
            root.count -= 1
            node, pos = root, s
            while True:
                t = seq[pos]
                ch = node.child(t)
                if ch is None:
                    break
                if type(ch) is not _Node:
                    if ch >> _SHIFT == sid:
                        node.drop(t)
                    break
                ch.count -= 1
                if ch.count <= 0:
                    node.drop(t)
                    break
                if node.best == t:
                    node.bestc = -1  # maybe no longer the top child: rescan when read
                node = ch
                pos += 1
                if pos >= L or pos - s >= D:
                    break

    def drop_seq(self, sid: int) -> None:
        """Forget sequence `sid` (after all its suffixes were removed)."""
        seq = self.seqs.pop(sid, None)
        self._active.pop(sid, None)
        if seq is not None:
            self.n_tokens -= len(seq)

    def remove(self, sid: int) -> None:
        """Remove sequence `sid` and all its suffixes' counts."""
        if sid in self.seqs:
            self.remove_range(sid, 0, len(self.seqs[sid]))
            self.drop_seq(sid)

    # ---- queries -----------------------------------------------------------
    def active_states(self, sid: int) -> list[tuple[int, _Node]]:
        """(match length, node) of the suffixes ending at the last token of `sid` that occur >= 2 times."""
        return [(i + 1, node) for i, node in enumerate(self._active.get(sid, ()))]

    def advance(self, states: list, t: int) -> list:
        """Matching states of a context after appending token t.

        states[i] is the state of the context's suffix of length i + 1 (those
        found in the trie have contiguous lengths): its _Node, or the leaf int
        if the string occurs once (ending at seqs[sid][pos]).
        """
        ch = self.root.child(t)
        if ch is None:
            return []
        out = [ch]
        seqs = self.seqs
        for obj in states[: self.max_depth - 1]:
            if type(obj) is _Node:
                ch = obj.child(t)
                if ch is None:
                    break
                out.append(ch)
            else:
                pos = obj & _POS
                seq = seqs[obj >> _SHIFT]
                if pos + 1 < len(seq) and seq[pos + 1] == t:
                    out.append(obj + 1)
                else:
                    break
        return out

    def match(self, context) -> list:
        """States for the suffixes of `context` (only its last max_depth tokens matter)."""
        states: list = []
        for t in list(context)[-self.max_depth :]:
            states = self.advance(states, int(t))
        return states

    def count(self, tokens) -> int:
        """Occurrences of a string (<= max_depth tokens)."""
        tokens = list(tokens)
        states = self.match(tokens)
        if not tokens or len(states) < len(tokens):
            return 0
        return _count(states[len(tokens) - 1])

    def walk(self, k: int, obj, budget: int, p_min: float) -> tuple[list[int], list[float]]:
        """Greedy most-frequent-child path from a state at depth k.

        Returns (tokens, probabilities); probability = running product of
        child/parent counts, the walk stops before it drops below p_min.
        """
        toks: list[int] = []
        probs: list[float] = []
        prob = 1.0
        depth = k
        D = self.max_depth
        while len(toks) < budget and depth < D:
            if type(obj) is _Node:
                if obj.bestc <= 0:
                    if obj.bestc == 0 or obj.fresh().bestc == 0:
                        break
                prob *= obj.bestc / obj.count
                if prob < p_min:
                    break
                t = obj.best
                toks.append(t)
                probs.append(prob)
                depth += 1
                obj = obj.one if obj.kids is None else obj.kids[t]
            else:  # single occurrence: the rest of the path is the sequence itself
                pos = obj & _POS
                seq = self.seqs[obj >> _SHIFT]
                m = min(budget - len(toks), len(seq) - pos - 1, D - depth)
                if m > 0:
                    toks.extend(seq[pos + 1 : pos + 1 + m])
                    probs.extend([prob] * m)
                break
        return toks, probs


    def runner_ups(self, k: int, obj, main: list[int], budget: int, p_min: float) -> list[Branch]:
        """Beside the greedy walk from a state at depth k whose first tokens are `main`: at each of its nodes
        with more than one child, the most frequent child other than the walk's, continued by its own greedy
        walk; its weight is its count over the walk's child's. Most likely first.

        >>> t = SuffixTrie(max_depth=16)
        >>> t.extend(0, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 7, 8, 1, 2, 3])
        >>> k, state = t.active_states(0)[2]           # "1 2 3", seen 3 times before the end
        >>> main, _ = t.walk(k, state, 4, 0.1); main
        [4, 1, 2, 3]
        >>> [(b.at, b.tokens.tolist(), b.weight) for b in t.runner_ups(k, state, main, 4, 0.1)]
        [(0, [7, 8, 1, 2], 0.5)]
        """
        out: list[Branch] = []
        for j, want in enumerate(main):
            if type(obj) is not _Node:
                break  # a single occurrence from here: one continuation
            obj.fresh()
            if obj.best != want or obj.bestc <= 0:
                break
            if obj.kids is not None:
                t2, c2 = -1, 0
                for t, ch in obj.kids.items():
                    if t != want and (c := _count(ch)) > c2:
                        t2, c2 = t, c
                if c2 > 0 and budget - j - 1 >= 0:
                    rest, _ = self.walk(k + j + 1, obj.kids[t2], budget - j - 1, p_min)
                    out.append(Branch(j, np.array([t2] + rest, np.int32), c2 / obj.bestc))
            obj = obj.one if obj.kids is None else obj.kids[want]
        out.sort(key=lambda b: -b.weight)
        return out


