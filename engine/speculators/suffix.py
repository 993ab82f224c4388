"""suffix: SuffixDecoding-style drafting from suffix tries (per request + global).

After SuffixDecoding (Arctic Inference, vLLM's `suffix` method) and
ik_llama.cpp's suffix speculator. Two tries of suffixes, each at most
`max_depth` tokens deep, with occurrence counts:

* a per-request trie over the request's own tokens (prompt + generated),
  grown by appending each new token to all still-growing suffixes;
* a global trie shared by all requests of the speculator, holding the
  generated tokens of finished requests (added at `end`); bounded by
  `global_max_seqs` and `global_max_tokens`, the oldest sequence is evicted
  first. Inserting and evicting is done in slices of
  `global_work_per_call` tokens per `draft()` call, so a finished request
  never stalls a round; the new sequence becomes visible when it is complete.

Drafting, for every match length k >= `min_match` at which the last k tokens
of the history occur in a trie: start at that trie node, repeatedly follow the
most frequent child while the running product of child/parent counts stays
>= `p_min`; each drafted token's probability is that product, a draft's score
is their sum. Budget per match: min(request n_max, `max_draft`,
floor(k * `max_spec_factor` + `max_spec_offset`), max_depth - k). The best
score over both tries wins (ties: the longer match, then the per-request
trie). The per-token probabilities of the chosen draft are kept in
`SuffixSpeculator.last_confidence[seq_id]` (and the trie it came from in
`last_source[seq_id]`).

As in SuffixDecoding, the per-request trie also counts the occurrence at the
very end of the history (which has no continuation yet): a context seen once
before drafts with probability 1/2.

Implementation: a trie whose single-occurrence branches stay implicit
("leaves" = one int encoding (sequence, position), read along the sequence),
and whose one-child nodes hold the child inline, so memory and insertion
cost grow with the repeated part of the text only; each new token costs
O(number of suffixes ending at it that occur more than once) <= max_depth.
The suffixes of a request's history that occur in the global trie are
tracked incrementally too, and recomputed from the last `max_depth` tokens
whenever the global trie gains or loses a sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.draft_tree import Branch
from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, HistoryCursor, as_tokens
from .kept_states import KeptStates

try:  # the compiled core of SuffixTrie.extend and .advance_through and of the look-up's pick (setup.py builds it)
    from ._suffix_core import LEAF_SHIFT as _CORE_SHIFT
    from ._suffix_core import advance as _core_advance
    from ._suffix_core import draft as _core_draft
    from ._suffix_core import extend as _core_extend
except ImportError:  # a source tree that was never built: the references (extend_reference, ...) run instead
    _CORE_SHIFT = _core_advance = _core_draft = _core_extend = None
#: whether SuffixTrie.extend and .advance_through and SuffixSpeculator's pick run compiled here
COMPILED_CORE = _core_extend is not None

_SHIFT = 32
_POS = (1 << _SHIFT) - 1
if _core_extend is not None and _CORE_SHIFT != _SHIFT:
    raise ImportError(f"_suffix_core.c's leaf shift {_CORE_SHIFT} is not suffix.py's {_SHIFT}: rebuild it")


class SuffixParams(BaseModel):
    """Parameters of the suffix speculator."""

    model_config = ConfigDict(extra="forbid")

    min_match: int = Field(5, ge=1, le=1024, description="shortest matched context (tokens) that may draft")
    max_depth: int = Field(64, ge=2, le=1024, description="trie depth: matched context + draft tokens")
    p_min: float = Field(0.1, ge=0.0, le=1.0, description="stop drafting when the path probability drops below this")
    max_draft: int = Field(32, ge=1, le=1024, description="at most this many draft tokens")
    max_spec_factor: float = Field(
        1.0, ge=0.0, description="draft at most match_length x this + max_spec_offset tokens (SuffixDecoding)"
    )
    max_spec_offset: float = Field(0.0, description="added to match_length x max_spec_factor")
    global_max_seqs: int = Field(
        1000, ge=0, description="finished sequences kept in the global trie (0 disables the global trie)"
    )
    global_max_tokens: int = Field(
        100_000, ge=0, description="tokens kept in the global trie (~0.35 KB each); oldest sequences go first"
    )
    global_include_prompt: bool = Field(False, description="also add finished requests' prompts to the global trie")
    global_work_per_call: int = Field(
        64, ge=0,
        description="global-trie tokens inserted/evicted per draft() call, so a finished sequence's insertion is "
        "spread over later rounds; 0 = all at once in end()",
    )
    keep_finished: int = Field(
        16, ge=0, description="finished requests whose per-request trie is kept for a request that continues one (a "
        "conversation's next turn starts from it and inserts only its new tokens); 0: none kept"
    )
    keep_finished_tokens: int = Field(
        65_536, ge=0, description="tokens the kept per-request tries hold, in all; the oldest trie goes first"
    )


class SuffixTrie:
    """Depth-bounded trie of all suffixes of one or more token sequences.

    Node i's fields live in flat lists (`_cnt`, `_best`, `_bestc`, `_one`, `_kids`), not in an object of its
    own, and a child is referred to by an int: ``~i`` (negative) for node i, or a leaf ``sid << 32 | pos``
    (not negative) meaning the string continues with seqs[sid][pos] and occurs only there; below a leaf the
    path follows the sequence (count 1 at every depth) until max_depth or the sequence end. A node with one
    child keeps it in `_one` (its token in `_best`); from two children on they live in a dict in `_kids`
    (token -> reference: ints only). A filled global trie holds hundreds of thousands of nodes, and ints and
    dicts of ints are nothing Python's cyclic garbage collector walks, where an object per node made every
    full collection walk them all. `_bestc[i] == -1` marks a stale best child (after a removal): it is
    rescanned before it is read, so removals never scan wide nodes (the root has a child per vocabulary
    token). Nodes a removal takes out keep their fields, so a state matched before the removal walks as it did,
    until `bump_version` says no state refers to them any more and they are reused.

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

    #: the root's reference
    ROOT = ~0

    #: extend and advance_through with the compiled core where it is built; False (on the class or a trie) runs
    #: the references
    compiled = True

    def __init__(self, max_depth: int, compiled: bool | None = None) -> None:
        self.max_depth = int(max_depth)
        if compiled is not None:
            self.compiled = compiled
        self._cnt: list[int] = [0]  # occurrences of node i's string
        self._best: list[int] = [-1]  # token of its most frequent child (first to reach the top count)
        self._bestc: list[int] = [0]  # that child's count; -1: stale
        self._one: list = [None]  # its only child's reference, while _kids[i] is None
        self._kids: list = [None]  # its children from two on: {token: reference}
        self._free: list[int] = []  # node indices to reuse
        self._taken_out: list[int] = []  # removed nodes, reused after the next bump_version
        self.seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[int]] = {}
        self.n_tokens = 0
        self.version = 0  # bumped by owners (bump_version) when matching states must be recomputed

    def contents(self) -> tuple:
        """Everything the trie holds, for comparing two tries: its node fields, the nodes to reuse and those
        awaiting the next bump_version, its sequences, their growing suffixes, its token count and version.

        >>> a, b = SuffixTrie(8), SuffixTrie(8, compiled=False)
        >>> a.extend(0, [1, 2, 1, 2, 3]); b.extend(0, [1, 2, 1, 2, 3])
        >>> a.contents() == b.contents()
        True
        """
        return (self._cnt, self._best, self._bestc, self._one, self._kids, self._free, self._taken_out, self.seqs,
                self._active, self.n_tokens, self.version)

    # ---- nodes ---------------------------------------------------------------
    def count_of(self, ref) -> int:
        """Occurrences of the string a child reference (a node or a leaf) stands for."""
        return self._cnt[~ref] if ref < 0 else 1

    def children(self, ref: int) -> list[tuple[int, int]]:
        """(token, reference) of node `ref`'s children."""
        i = ~ref
        kids = self._kids[i]
        if kids is not None:
            return list(kids.items())
        return [] if self._one[i] is None else [(self._best[i], self._one[i])]

    def best_of(self, ref: int) -> tuple[int, int]:
        """(token, count) of node `ref`'s most frequent child, (-1, 0) without children."""
        i = ~ref
        if self._bestc[i] < 0:
            self._rescan(i)
        return self._best[i], self._bestc[i]

    def holds_children_inline(self, ref: int) -> bool:
        """Whether node `ref` keeps its children without a dict (it has at most one)."""
        return self._kids[~ref] is None

    @property
    def n_nodes(self) -> int:
        """Nodes in use (the root included)."""
        return len(self._cnt) - len(self._free) - len(self._taken_out)

    @property
    def n_slots(self) -> int:
        """Node slots the lists hold: in use, free, or taken out and awaiting the next bump_version."""
        return len(self._cnt)

    def _new(self, count: int) -> int:
        free = self._free
        if free:
            i = free.pop()
            self._cnt[i], self._best[i], self._bestc[i], self._one[i], self._kids[i] = count, -1, 0, None, None
        else:
            i = len(self._cnt)
            self._cnt.append(count)
            self._best.append(-1)
            self._bestc.append(0)
            self._one.append(None)
            self._kids.append(None)
        return ~i

    def _child(self, i: int, t: int):
        kids = self._kids[i]
        if kids is None:
            return self._one[i] if self._best[i] == t else None
        return kids.get(t)

    def _put_new(self, i: int, t: int, ch, c: int) -> None:
        """Add child t (not a child yet) with count c to node i."""
        kids = self._kids[i]
        if kids is None:
            if self._one[i] is None:
                self._one[i], self._best[i], self._bestc[i] = ch, t, c
                return
            self._kids[i] = kids = {self._best[i]: self._one[i]}
            self._one[i] = None
        kids[t] = ch
        if c > self._bestc[i] >= 0:
            self._best[i], self._bestc[i] = t, c

    def _drop(self, i: int, t: int) -> None:
        """Node i loses child t; a node child is taken out with everything below it."""
        kids = self._kids[i]
        if kids is None:
            ch = self._one[i]
            self._one[i], self._best[i], self._bestc[i] = None, -1, 0
        else:
            ch = kids.pop(t)
            if len(kids) == 1:
                ((tt, cc),) = kids.items()
                self._kids[i], self._one[i], self._best[i], self._bestc[i] = None, cc, tt, self.count_of(cc)
            elif self._best[i] == t:
                self._bestc[i] = -1  # stale (dict nodes only read best after a rescan)
        if ch is not None and ch < 0:  # its fields stay as they are until reused: a state may still walk it
            one, kids_of, taken = self._one, self._kids, self._taken_out
            stack = [~ch]
            while stack:
                j = stack.pop()
                taken.append(j)
                below = kids_of[j]
                if below is None:
                    r = one[j]
                    if r is not None and r < 0:
                        stack.append(~r)
                else:
                    stack += [~r for r in below.values() if r < 0]

    def _rescan(self, i: int) -> None:
        """Recompute node i's best child (after counts went down)."""
        items = self.children(~i)  # before best is reset: a lone child is keyed by it
        best, bestc = -1, 0
        for t, ch in items:
            c = self.count_of(ch)
            if c > bestc:
                best, bestc = t, c
        self._best[i], self._bestc[i] = best, bestc

    def bump_version(self) -> None:
        """The trie gained or lost a sequence: matching states made before must be recomputed (`version`), and
        the nodes removals took out since the last bump, which such states may still name, can be reused."""
        self.version += 1
        self._free += self._taken_out
        self._taken_out = []

    # ---- building ----------------------------------------------------------
    def extend(self, sid: int, tokens) -> None:
        """Append tokens to sequence `sid` (created if new), inserting every new suffix.

        The suffixes ending at the last token that occur more than once are
        explicit nodes and have contiguous lengths 1..K (a suffix of a repeated
        string is repeated): they are kept as a list by length, and each new
        token extends them shortest first (O(K) per token). `sid` is not negative: a leaf names it, and a
        negative leaf would read as a node. Runs the compiled core (_suffix_core.c) where it is built, else
        `extend_reference`: the two leave the same trie.
        """
        if _core_extend is None or not self.compiled:
            self.extend_reference(sid, tokens)
            return
        if sid < 0:
            raise ValueError(f"sequence id must be >= 0, got {sid}")
        seq = self.seqs.setdefault(sid, [])
        n0 = len(seq)
        self._active[sid] = _core_extend(seq, self._active.get(sid, []), tokens, sid << _SHIFT, self.max_depth,
                                         self.seqs, self._active, self._cnt, self._best, self._bestc, self._one,
                                         self._kids, self._free, self._rescan)
        self.n_tokens += len(seq) - n0

    def extend_reference(self, sid: int, tokens) -> None:
        """`extend` in pure Python: the reference the compiled core is held to (tests/unit/test_spec_suffix_core.py),
        and what runs where the core is not built."""
        if sid < 0:
            raise ValueError(f"sequence id must be >= 0, got {sid}")
        seq = self.seqs.setdefault(sid, [])
        act = self._active.get(sid, [])  # act[i]: node index of the suffix of length i + 1
        D = self.max_depth
        seqs = self.seqs
        actives = self._active
        cnt, best, bestc, one, kids_of = self._cnt, self._best, self._bestc, self._one, self._kids
        base = sid << _SHIFT
        for t in tokens:
            t = int(t)
            cur = len(seq)
            seq.append(t)
            cnt[0] += 1
            new: list[int] = []
            node = 0  # the root's index
            i = 0  # act index of the next node; `node` has depth i
            n_act = len(act)
            while True:
                kids = kids_of[node]
                if kids is None:
                    ch = one[node] if best[node] == t else None
                else:
                    ch = kids.get(t)
                if ch is None:
                    # the string is new here, hence also for every longer suffix
                    leaf = base | cur
                    while True:
                        self._put_new(node, t, leaf, 1)
                        if i >= n_act:
                            break
                        node = act[i]
                        i += 1
                    break
                if ch < 0:
                    j = ~ch
                    c = cnt[j] = cnt[j] + 1
                else:  # split a leaf: its occurrence and ours
                    q = ch & _POS
                    sid2 = ch >> _SHIFT
                    seq2 = seqs[sid2]
                    m = self._new(2)
                    j = ~m
                    if q + 1 < len(seq2):
                        if i + 2 <= D:
                            one[j], best[j], bestc[j] = ch + 1, seq2[q + 1], 1
                    elif sid2 in actives and i + 1 < D:
                        # the leaf was the growing end of another (unfinished) sequence:
                        # that suffix is now explicit and must grow with its sequence
                        act2 = actives[sid2]
                        if len(act2) == i:
                            act2.append(j)
                    if kids is None:
                        one[node] = m
                    else:
                        kids[t] = m
                    c = 2
                bc = bestc[node]
                if c > bc:
                    if bc < 0:
                        self._rescan(node)
                    else:
                        best[node], bestc[node] = t, c
                new.append(j)
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
        cnt, best, bestc, one, kids_of = self._cnt, self._best, self._bestc, self._one, self._kids
        for s in range(start, min(stop, L)):
            cnt[0] -= 1
            node, pos = 0, s
            while True:
                t = seq[pos]
                kids = kids_of[node]  # _child, inlined: the walk down runs for every removed suffix
                if kids is None:
                    ch = one[node] if best[node] == t else None
                else:
                    ch = kids.get(t)
                if ch is None:
                    break
                if ch >= 0:
                    if ch >> _SHIFT == sid:
                        self._drop(node, t)
                    break
                j = ~ch
                cnt[j] -= 1
                if cnt[j] <= 0:
                    self._drop(node, t)
                    break
                if best[node] == t:
                    bestc[node] = -1  # maybe no longer the top child: rescan when read
                node = j
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
    def active_states(self, sid: int) -> list[tuple[int, int]]:
        """(match length, node reference) of the suffixes ending at the last token of `sid` that occur >= 2
        times."""
        return [(i + 1, ~j) for i, j in enumerate(self._active.get(sid, ()))]

    def core_fields(self) -> tuple:
        """What the compiled pick (_suffix_core.c draft) reads of the trie: its node fields, sequences, depth and
        its rescan (a node's stale best child)."""
        return self._cnt, self._best, self._bestc, self._one, self._kids, self.seqs, self.max_depth, self._rescan

    def active_nodes(self, sid: int) -> list[int]:
        """The node indices of `active_states(sid)`, shortest suffix first (the list the trie keeps: not a copy)."""
        return self._active.get(sid, [])

    def advance(self, states: list, t: int) -> list:
        """Matching states of a context after appending token t.

        states[i] is the state of the context's suffix of length i + 1 (those
        found in the trie have contiguous lengths): its node's reference, or the
        leaf if the string occurs once (ending at seqs[sid][pos]).
        """
        ch = self._child(0, t)
        if ch is None:
            return []
        out = [ch]
        seqs = self.seqs
        for obj in states[: self.max_depth - 1]:
            if obj < 0:
                ch = self._child(~obj, t)
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

    def advance_through(self, states: list, tokens) -> list:
        """`advance` by each of `tokens` in turn: the states of the context followed by them. Runs the compiled core
        (_suffix_core.c) where it is built, else `advance_through_reference`: the two give the same states.

        >>> t = SuffixTrie(max_depth=8)
        >>> t.extend(0, [1, 2, 3, 1, 2, 4])
        >>> [t.count_of(s) for s in t.advance_through([], [5, 1, 2])]   # "2" and "1 2" twice each; "5 1 2" never
        [2, 2]
        """
        if _core_advance is None or not self.compiled:
            return self.advance_through_reference(states, tokens)
        return _core_advance(states, tokens, self.max_depth, self.seqs, self._best, self._one, self._kids)

    def advance_through_reference(self, states: list, tokens) -> list:
        """`advance_through` in pure Python: the reference the compiled core is held to
        (tests/unit/test_spec_suffix_core.py), and what runs where the core is not built."""
        for t in tokens:
            states = self.advance(states, int(t))
        return states

    def match(self, context) -> list:
        """States for the suffixes of `context` (only its last max_depth tokens matter)."""
        return self.advance_through([], list(context)[-self.max_depth :])

    def count(self, tokens) -> int:
        """Occurrences of a string (<= max_depth tokens)."""
        tokens = list(tokens)
        states = self.match(tokens)
        if not tokens or len(states) < len(tokens):
            return 0
        return self.count_of(states[len(tokens) - 1])

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
        cnt, best, bestc, one, kids_of = self._cnt, self._best, self._bestc, self._one, self._kids
        while len(toks) < budget and depth < D:
            if obj < 0:
                i = ~obj
                if cnt[i] <= 0:  # taken out by a removal a state made before it still names
                    break
                bc = bestc[i]
                if bc <= 0:
                    if bc == 0:
                        break
                    self._rescan(i)
                    bc = bestc[i]
                    if bc == 0:
                        break
                prob *= bc / cnt[i]
                if prob < p_min:
                    break
                t = best[i]
                toks.append(t)
                probs.append(prob)
                depth += 1
                kids = kids_of[i]
                obj = one[i] if kids is None else kids[t]
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
            if obj >= 0:
                break  # a single occurrence from here: one continuation
            i = ~obj
            b, bc = self.best_of(obj)
            if b != want or bc <= 0:
                break
            kids = self._kids[i]
            if kids is not None:
                t2, c2 = -1, 0
                for t, ch in kids.items():
                    if t != want and (c := self.count_of(ch)) > c2:
                        t2, c2 = t, c
                if c2 > 0 and budget - j - 1 >= 0:
                    rest, _ = self.walk(k + j + 1, kids[t2], budget - j - 1, p_min)
                    out.append(Branch(j, np.array([t2] + rest, np.int32), c2 / bc))
            obj = self._one[i] if kids is None else kids[want]
        out.sort(key=lambda b: -b.weight)
        return out


@dataclass
class Draft:
    tokens: list[int]
    probs: list[float]
    score: float
    match_len: int
    source: str  # "request" or "global"
    trie: "SuffixTrie | None" = None  # where it was walked, from which state (its runner-ups: SuffixTrie.runner_ups)
    state: object = None
    budget: int = 0


def suffix_draft(
    candidates: list[tuple[SuffixTrie, str, int, object]],
    n_max: int,
    min_match: int = 5,
    p_min: float = 0.1,
    max_spec_factor: float = 1.0,
    max_spec_offset: float = 0.0,
) -> Draft | None:
    """Best-scoring draft over (trie, source, match length, state) candidates.

    Candidates are tried longest match first; one whose budget x first-step
    probability cannot beat the best score so far is skipped (a path's score is
    at most its length times its first probability).

    >>> t = SuffixTrie(max_depth=16)
    >>> t.extend(0, [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    >>> c = [(t, "request", k, s) for k, s in t.active_states(0)]
    >>> d = suffix_draft(c, n_max=8, min_match=2, p_min=0.1)
    >>> d.tokens, d.probs, d.match_len     # "1 2 3" seen before (+ at the end): p = 1/2
    ([4, 5, 6], [0.5, 0.5, 0.5], 3)
    >>> suffix_draft(c, n_max=8, min_match=2, p_min=0.6) is None
    True
    """
    best: Draft | None = None
    best_score = 0.0
    # Consecutive match lengths with the same count have the same occurrences, so
    # their walks agree up to the budget: walk only the one with the largest budget.
    groups: dict[tuple[int, int], tuple] = {}
    for i, (trie, source, k, state) in enumerate(candidates):
        if k < min_match:
            continue
        budget = min(n_max, int(k * max_spec_factor + max_spec_offset + 1e-6), trie.max_depth - k)
        if budget <= 0:
            continue
        key = (id(trie), trie.count_of(state))
        g = groups.get(key)
        if g is None or (budget, k) > (g[0], g[1]):
            groups[key] = (budget, k, trie, source, i, state)
    # longest match first (ties keep the longer match); skip what cannot beat the best
    for budget, k, trie, source, _, state in sorted(groups.values(), key=lambda g: (-g[1], g[4])):
        if state < 0:  # a node (a leaf's walk is the rest of its sequence, each token at probability 1)
            _, bc = trie.best_of(state)
            n = trie.count_of(state)  # 0: taken out by a removal since the state was matched
            if bc <= 0 or n <= 0 or budget * bc / n <= best_score:
                continue
        elif budget <= best_score:
            continue
        toks, probs = trie.walk(k, state, budget, p_min)
        if not toks:
            continue
        score = sum(probs)
        if score > best_score:
            best_score = score
            best = Draft(toks, probs, score, k, source, trie, state, budget)
    return best


class _ReqState:
    __slots__ = ("trie", "cursor", "prompt_len", "gstates", "gversion", "prompt")

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.cursor = HistoryCursor()
        self.prompt: np.ndarray | None = None  # indexed as the target prefills it (prefilling)
        self.prompt_len = -1  # unknown until begin / first draft
        self.gstates: list = []  # matches of the history's suffixes in the global trie
        self.gversion = -1


class SuffixSpeculator(Speculator):
    """SuffixDecoding: per-request + global suffix tries, best path by summed probability."""

    name = "suffix"
    offers_branches = True

    def __init__(self, params: SuffixParams | None = None) -> None:
        super().__init__()
        self.params = p = params or SuffixParams()
        self.global_trie = SuffixTrie(p.max_depth)
        self._global_order: OrderedDict[int, int] = OrderedDict()  # complete sids -> length, oldest first
        self._global_tokens = 0  # tokens of the sequences in _global_order
        self._jobs: deque[list] = deque()  # pending global work: ["add"|"remove", sid, tokens, done]
        self._next_gsid = 0
        self._seqs: dict[int, _ReqState] = {}
        self.last_confidence: dict[int, np.ndarray] = {}
        self.last_source: dict[int, str] = {}
        self.last_match_len: dict[int, int] = {}
        self._walks: dict[int, Draft] = {}  # this round's chosen walk per sequence, for its runner-ups
        # finished requests' tries, for the requests that continue them (kept_states.py)
        self.kept = KeptStates(p.keep_finished, p.keep_finished_tokens)

    # ---- per-request state -------------------------------------------------
    def _sync(self, st: _ReqState, h: np.ndarray) -> None:
        if not st.cursor.is_extension(h):
            st.trie = SuffixTrie(self.params.max_depth)
            st.cursor = HistoryCursor()
            st.gstates, st.gversion, st.prompt_len = [], -1, -1
        n0 = st.cursor.n
        g = self.global_trie
        if len(h) > n0:
            new = h[n0:].tolist()
            st.trie.extend(0, new)
            if st.gversion == g.version:
                if len(new) >= g.max_depth:  # only the last max_depth tokens matter
                    st.gstates = g.match(new)
                else:
                    st.gstates = g.advance_through(st.gstates, new)
        st.cursor.advance(h)
        if st.gversion != g.version:
            st.gstates = g.match(st.trie.seqs.get(0, [])[-g.max_depth :]) if g.n_tokens else []
            st.gversion = g.version

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        prompt = as_tokens(prompt)
        st = self.kept.take(prompt) if len(prompt) else None
        if st is None:
            st = _ReqState(self.params.max_depth)
        else:
            self.stats.continued += 1
            self.stats.continued_tokens += st.cursor.n
        self._seqs[seq_id] = st
        st.prompt, st.prompt_len = prompt, len(prompt)  # indexed as the target prefills it, or at the first draft
        self.last_confidence.pop(seq_id, None)

    def _prefilling(self, seq_id: int, n: int) -> None:
        st = self._seqs.get(seq_id)
        if st is not None and st.prompt is not None and n > st.cursor.n:
            self._sync(st, st.prompt[:n])
            st.prompt_len = len(st.prompt)  # _sync starts a new trie where the history changed

    def indexed(self, seq_id: int) -> int:
        """How many tokens of seq_id's history its trie holds (0: none, or no such sequence)."""
        st = self._seqs.get(seq_id)
        return st.cursor.n if st is not None else 0

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        if self._jobs and self.params.global_work_per_call > 0:
            self._pump(self.params.global_work_per_call)  # timed with the drafts below
        return super().draft(requests)

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        p = self.params
        st = self._seqs.get(req.seq_id)
        if st is None:
            st = self._seqs[req.seq_id] = _ReqState(p.max_depth)
        h = as_tokens(req.history)
        self._sync(st, h)
        if st.prompt_len < 0:
            st.prompt_len = len(h) - 1
        d = self._pick(st, min(req.n_max, p.max_draft))
        self._walks.pop(req.seq_id, None)
        if d is None:
            self.last_confidence[req.seq_id] = np.zeros(0)
            self.last_source.pop(req.seq_id, None)
            return EMPTY_DRAFT
        self.last_confidence[req.seq_id] = np.array(d.probs)
        self.last_source[req.seq_id] = d.source
        self.last_match_len[req.seq_id] = d.match_len
        self._walks[req.seq_id] = d
        return np.array(d.tokens, dtype=np.int32)

    def _pick(self, st: _ReqState, n_max: int) -> Draft | None:
        """The sequence's best draft over its matches in its own trie and the global one (suffix_draft). Runs the
        compiled core (_suffix_core.c draft) where it is built and both tries are compiled, else `_pick_reference`:
        the two pick the same walk."""
        g, p = self.global_trie, self.params
        if _core_draft is None or not (st.trie.compiled and g.compiled):
            return self._pick_reference(st, n_max)
        got = _core_draft(st.trie.active_nodes(0), st.trie.core_fields(), st.gstates, g.core_fields(), n_max,
                          p.min_match, p.p_min, p.max_spec_factor, p.max_spec_offset)
        if got is None:
            return None
        tokens, probs, score, k, from_global, state, budget = got
        trie, source = (g, "global") if from_global else (st.trie, "request")
        return Draft(tokens, probs, score, k, source, trie, state, budget)

    def _pick_reference(self, st: _ReqState, n_max: int) -> Draft | None:
        """`_pick` in Python: suffix_draft over the candidates, the reference the compiled pick is held to
        (tests/unit/test_spec_suffix_core.py)."""
        p = self.params
        cands = [(st.trie, "request", k, s) for k, s in st.trie.active_states(0)]
        cands += [(self.global_trie, "global", i + 1, s) for i, s in enumerate(st.gstates)]
        return suffix_draft(cands, n_max, p.min_match, p.p_min, p.max_spec_factor, p.max_spec_offset)

    def _branches(self, seq_id: int, main: list[int], width: int) -> list[Branch]:
        d = self._walks.pop(seq_id, None)
        if d is None or d.tokens[: len(main)] != main:
            return []
        return d.trie.runner_ups(d.match_len, d.state, main, d.budget, self.params.p_min)

    def draft_context(self, seq_id: int) -> int:
        """Bucket of the last draft's match length (< 8, 8-11, 12-19, 20+ tokens): drafts after a longer match
        keep more of their tokens, so each bucket has its own acceptance estimate.

        >>> s = SuffixSpeculator(); s.last_match_len.update({1: 5, 2: 8, 3: 12, 4: 40})
        >>> [s.draft_context(i) for i in (0, 1, 2, 3, 4)]
        [0, 0, 1, 2, 3]
        """
        k = self.last_match_len.get(seq_id, 0)
        return 0 if k < 8 else 1 if k < 12 else 2 if k < 20 else 3

    def _end(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        self.last_confidence.pop(seq_id, None)
        self.last_source.pop(seq_id, None)
        self.last_match_len.pop(seq_id, None)
        self._walks.pop(seq_id, None)
        if st is None:
            return
        seq = st.trie.seqs.get(0, [])
        self.add_global(seq if self.params.global_include_prompt else seq[max(st.prompt_len, 0) :])
        if seq:
            self.kept.put(np.array(seq, dtype=np.int32), st)

    # ---- global trie -------------------------------------------------------
    def add_global(self, tokens) -> None:
        """Queue a finished token sequence for the global trie (oldest evicted beyond the bounds)."""
        p = self.params
        if p.global_max_seqs <= 0 or p.global_max_tokens <= 0:
            return
        toks = [int(t) for t in tokens][-p.global_max_tokens :]
        if len(toks) < 2:
            return
        self._jobs.append(["add", self._next_gsid, toks, 0])
        self._next_gsid += 1
        if p.global_work_per_call == 0:
            self.flush_global()

    def flush_global(self) -> None:
        """Finish all pending global-trie insertions and evictions now."""
        self._pump(None)

    def _pump(self, budget: int | None) -> None:
        g = self.global_trie
        jobs = self._jobs
        while jobs and (budget is None or budget > 0):
            job = jobs[0]
            kind, sid, toks, done = job
            if kind == "add":
                n = len(toks) - done if budget is None else min(budget, len(toks) - done)
                g.extend(sid, toks[done : done + n])
                job[3] = done = done + n
                if done >= len(toks):
                    jobs.popleft()
                    g.finish(sid)
                    g.bump_version()
                    self._global_order[sid] = len(toks)
                    self._global_tokens += len(toks)
                    self._evict()
            else:
                L = len(g.seqs[sid])
                n = L - done if budget is None else min(budget, L - done)
                g.remove_range(sid, done, done + n)
                job[3] = done = done + n
                if done >= L:
                    jobs.popleft()
                    g.drop_seq(sid)
                    g.bump_version()
            if budget is not None:
                budget -= max(n, 1)

    def _evict(self) -> None:
        p = self.params
        while self._global_order and (
            len(self._global_order) > p.global_max_seqs or self._global_tokens > p.global_max_tokens
        ):
            old, n = self._global_order.popitem(last=False)
            self._global_tokens -= n
            self._jobs.append(["remove", old, None, 0])

    def get_state(self):
        """The global trie's sequences, oldest first (picklable)."""
        self.flush_global()
        return {"global_seqs": [list(self.global_trie.seqs[sid]) for sid in self._global_order]}

    def set_state(self, state) -> None:
        if not state:
            return
        old = self.global_trie
        self.global_trie = SuffixTrie(self.params.max_depth)
        self.global_trie.version = old.version + 1  # request states must rematch
        self._global_order.clear()
        self._global_tokens = 0
        self._jobs.clear()
        for seq in state.get("global_seqs", []):
            self.add_global(seq)
        self.flush_global()
