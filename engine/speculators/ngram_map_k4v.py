"""ngram_map_k4v: like ngram_map_k, but each key keeps up to 4 continuations with counts.

After llama.cpp's `common_ngram_map_draft` with `key_only = false`
(`--spec-type ngram-map-k4v`). For every indexed occurrence of a key n-gram the
`size_m` tokens that followed it (the "value" m-gram) are counted; a key keeps
at most 4 distinct values (a fifth distinct one is ignored, as in llama.cpp).
A draft is made only if the most frequent value dominates: its count is at
least twice the other values' counts combined, and at least `min_hits`. The
draft is that value, cut to the number of tokens accepted the last time that
(key, value) drafted (all `size_m` on first use).

Statistics are updated incrementally as positions become indexable.
Differences from llama.cpp, in the direction of its intent:
* the statistics cover every indexed occurrence of the key (llama.cpp only
  counts occurrences up to the position its hash lookup returned);
* the drafted tokens are those of the winning value (llama.cpp copies the
  tokens after the looked-up position, which may hold another value);
* `min_hits` is compared with the winning value's count (llama.cpp compares the
  number of draft calls that hit the key; with the default 1 they agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.draft_tree import Branch
from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, as_tokens
from .ngram_map_k import NgramKeyIndex

MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT


class NgramMapK4vParams(BaseModel):
    """Parameters of ngram_map_k4v (llama.cpp `common_params_speculative_ngram_map` defaults)."""

    model_config = ConfigDict(extra="forbid")

    size_n: int = Field(12, ge=1, le=1024, description="key length: the last size_n tokens of the history")
    size_m: int = Field(
        48, ge=1, le=1024,
        description="value length: continuations are compared over size_m tokens and at most size_m are drafted",
    )
    min_hits: int = Field(1, ge=1, le=MAX_VALUE_COUNT, description="occurrences the winning value needs before it drafts")


class NgramValueIndex(NgramKeyIndex):
    """NgramKeyIndex plus, per key, up to 4 values ``[value bytes, first start of key, count]``.

    >>> ix = NgramValueIndex(n=1, m=2)
    >>> h = np.array([7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 0, 7], np.int32)
    >>> ix.sync(h)
    >>> [(np.frombuffer(v[0], np.int32).tolist(), v[1], v[2]) for v in ix.values[h[-1:].tobytes()]]
    [([1, 2], 0, 2), ([3, 4], 6, 1)]
    """

    __slots__ = ("values",)

    def __init__(self, n: int, m: int) -> None:
        super().__init__(n, m)
        self.values: dict[bytes, list[list]] = {}

    def reset(self) -> None:
        super().reset()
        self.values.clear()

    def _on_indexed(self, h: np.ndarray, j: int, key: bytes) -> None:
        vb = h[j + self.n : j + self.n + self.m].tobytes()
        vals = self.values.get(key)
        if vals is None:
            self.values[key] = [[vb, j, 1]]
            return
        for v in vals:
            if v[0] == vb:
                if v[2] < MAX_VALUE_COUNT:
                    v[2] += 1
                return
        if len(vals) < MAX_VALUES:
            vals.append([vb, j, 1])


def ngram_map_k4v_draft(
    index: NgramValueIndex,
    history: np.ndarray,
    n_accepted: dict[tuple[bytes, int], int] | None = None,
    min_hits: int = 1,
) -> tuple[np.ndarray, tuple[bytes, int] | None]:
    """Sync `index` with `history` and draft; returns (draft, (key, value slot) or None).

    >>> ix = NgramValueIndex(n=1, m=2)
    >>> h = np.array([7, 1, 2, 7, 3, 4, 0, 0, 7], np.int32)
    >>> ngram_map_k4v_draft(ix, h)[0]             # 1 x [1 2] vs 1 x [3 4]: 1 < 2*1, no draft
    array([], dtype=int32)
    >>> h = np.array([7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 0, 7], np.int32)
    >>> ngram_map_k4v_draft(ix, h)[0]             # 2 x [1 2] >= 2 * (1 x [3 4])
    array([1, 2], dtype=int32)
    """
    h = as_tokens(history)
    index.sync(h)
    n = index.n
    if len(h) <= n:
        return EMPTY_DRAFT, None
    key = h[len(h) - n :].tobytes()
    vals = index.values.get(key)
    if not vals:
        return EMPTY_DRAFT, None
    slot, top = 0, vals[0][2]
    total = 0
    for i, v in enumerate(vals):
        total += v[2]
        if v[2] > top:
            slot, top = i, v[2]
    others = total - top
    if (others > 0 and top < 2 * others) or top < min_hits:
        return EMPTY_DRAFT, None
    k = index.m if n_accepted is None else n_accepted.get((key, slot), index.m)
    k = min(index.m, k)
    j = vals[slot][1]
    return h[j + n : j + n + k].copy(), (key, slot)


def value_branches(index: NgramValueIndex, history: np.ndarray, key: bytes, slot: int) -> list[Branch]:
    """The key's other values beside the drafted one (`slot`), each a branch where it leaves the drafted value,
    most frequent first; a value's weight is its count over the drafted value's.

    >>> ix = NgramValueIndex(n=1, m=2)
    >>> h = np.array([7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7, 1, 5, 7], np.int32)
    >>> d, (key, slot) = ngram_map_k4v_draft(ix, h)    # 4 x [1 2] >= 2 x (1 x [3 4] + 1 x [1 5])
    >>> d.tolist(), [(b.at, b.tokens.tolist(), b.weight) for b in value_branches(ix, h, key, slot)]
    ([1, 2], [(0, [3, 4], 0.25), (1, [5], 0.25)])
    """
    vals = index.values.get(key) or []
    top = vals[slot][2]
    n, m = index.n, index.m
    main = history[vals[slot][1] + n : vals[slot][1] + n + m]
    out = []
    for i, v in enumerate(vals):
        value = history[v[1] + n : v[1] + n + m]
        same = np.flatnonzero(value[: len(main)] != main[: len(value)])
        if i == slot or not same.size:
            continue
        out.append(Branch(int(same[0]), value[same[0] :].copy(), v[2] / top))
    out.sort(key=lambda b: -b.weight)
    return out


@dataclass
class _SeqState:
    index: NgramValueIndex
    n_accepted: dict[tuple[bytes, int], int] = field(default_factory=dict)
    last: tuple[bytes, int] | None = None
    history: np.ndarray | None = None  # the last draft's history, for its runner-ups (same round only)


class NgramMapK4vSpeculator(Speculator):
    """llama.cpp `ngram-map-k4v`: draft the dominant of up to 4 continuations of the key."""

    name = "ngram_map_k4v"
    offers_branches = True

    def __init__(self, params: NgramMapK4vParams | None = None) -> None:
        super().__init__()
        self.params = params or NgramMapK4vParams()
        self._seqs: dict[int, _SeqState] = {}

    def _new_state(self) -> _SeqState:
        return _SeqState(NgramValueIndex(self.params.size_n, self.params.size_m))

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        st = self._new_state()
        st.index.sync(prompt)
        self._seqs[seq_id] = st

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        st = self._seqs.get(req.seq_id)
        if st is None:
            st = self._seqs[req.seq_id] = self._new_state()
        h = as_tokens(req.history)
        if not st.index.cursor.is_extension(h):
            st.n_accepted.clear()
        d, st.last = ngram_map_k4v_draft(st.index, h, st.n_accepted, self.params.min_hits)
        st.history = h if len(d) else None
        if not len(d):
            st.last = None
        return d

    def _branches(self, seq_id: int, main: list[int], width: int) -> list[Branch]:
        st = self._seqs.get(seq_id)
        if st is None or st.last is None or st.history is None:
            return []
        h, (key, slot) = st.history, st.last
        st.history = None
        v = st.index.values[key][slot]
        if h[v[1] + st.index.n : v[1] + st.index.n + len(main)].tolist() != main:
            return []
        return value_branches(st.index, h, key, slot)

    def _accept(self, seq_id: int, n_drafted: int, n_accepted: int, winner: bool) -> None:
        st = self._seqs.get(seq_id)
        if st is None or not winner or st.last is None:
            return
        st.n_accepted[st.last] = int(n_accepted)
        st.last = None

    def _end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
