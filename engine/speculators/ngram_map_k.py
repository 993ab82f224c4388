"""ngram_map_k: hash table of earlier n-grams, draft length adapted per key.

After llama.cpp's `common_ngram_map_draft` in key-only mode (common/ngram-map.cpp,
`--spec-type ngram-map-k`). The key is the last `size_n` tokens of the history
(llama.cpp: last n-1 tokens + the sampled one). Every earlier n-gram that is
followed by at least `size_m` tokens of `history[:-1]` is indexed in a dict
``n-gram bytes -> first start position`` (a dict compares the full key, so
there are no hash collisions to verify). A hit drafts the tokens that followed
the key's first occurrence; the draft is `size_m` tokens the first time a key
is used and afterwards as many as the target accepted the last time that key's
draft was chosen (llama.cpp's per-value `n_accepted`; 0 silences the key).

Indexing is incremental: each call indexes only the positions that became
indexable since the previous call (O(new tokens)), lookups are O(size_n).

Differences from llama.cpp, all in the direction of its intent:
* the dict keeps the first occurrence for every key (llama.cpp's 2^18-slot
  hash keeps whatever was stored first in a slot and falls back to linear
  scans of not-yet-hashed ranges);
* `min_hits` counts earlier occurrences of the key (llama.cpp ignores it in
  key-only mode; with the default 1 both behave the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, HistoryCursor, as_tokens


class NgramMapKParams(BaseModel):
    """Parameters of ngram_map_k (llama.cpp `common_params_speculative_ngram_map` defaults)."""

    model_config = ConfigDict(extra="forbid")

    size_n: int = Field(12, ge=1, le=1024, description="key length: the last size_n tokens of the history")
    size_m: int = Field(
        48, ge=1, le=1024,
        description="tokens drafted after a key on its first use; an n-gram is indexed once size_m tokens follow it",
    )
    min_hits: int = Field(1, ge=1, le=16380, description="earlier occurrences a key needs before it drafts")


class NgramKeyIndex:
    """Incremental index of one sequence: n-gram -> first start, and its occurrence count.

    Position j is indexed once ``j + n + m <= len(history) - 1``, i.e. when the
    n-gram at j is followed by m tokens that are not the last sampled token.

    >>> ix = NgramKeyIndex(n=2, m=2)
    >>> h = np.array([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], np.int32)
    >>> ix.sync(h)
    >>> ix.n_indexed                      # j <= 10 - 1 - 2 - 2 = 5
    6
    >>> ix.find(h[-2:]), ix.count(h[-2:]) # [1 2] first at 0, seen at 0 and 4
    (0, 2)
    >>> ix.find(np.array([7, 7], np.int32))
    -1
    """

    __slots__ = ("n", "m", "first", "counts", "cursor", "n_indexed")

    def __init__(self, n: int, m: int) -> None:
        self.n = int(n)
        self.m = int(m)
        self.first: dict[bytes, int] = {}
        self.counts: dict[bytes, int] = {}
        self.cursor = HistoryCursor()
        self.n_indexed = 0  # positions [0, n_indexed) are indexed

    def reset(self) -> None:
        self.first.clear()
        self.counts.clear()
        self.cursor.reset()
        self.n_indexed = 0

    def limit(self, length: int) -> int:
        """Number of indexable positions for a history of `length` tokens."""
        return max(0, length - self.n - self.m)

    def sync(self, h: np.ndarray) -> None:
        """Index what is new in `h`; rebuild if `h` does not extend what was seen."""
        if not self.cursor.is_extension(h):
            self.reset()
        stop = self.limit(len(h))
        start = self.n_indexed
        if stop > start:
            self._index(h, start, stop)
            self.n_indexed = stop
        self.cursor.advance(h)

    def _index(self, h: np.ndarray, start: int, stop: int) -> None:
        n, isz = self.n, h.itemsize
        kb = h[start : stop - 1 + n].tobytes()
        first, counts = self.first, self.counts
        step = n * isz
        for j in range(stop - start):
            key = kb[j * isz : j * isz + step]
            c = counts.get(key)
            if c is None:
                counts[key] = 1
                first[key] = start + j
            else:
                counts[key] = c + 1
            self._on_indexed(h, start + j, key)

    def _on_indexed(self, h: np.ndarray, j: int, key: bytes) -> None:
        """Hook for subclasses (value statistics)."""

    def find(self, key_tokens: np.ndarray) -> int:
        return self.first.get(as_tokens(key_tokens).tobytes(), -1)

    def count(self, key_tokens: np.ndarray) -> int:
        return self.counts.get(as_tokens(key_tokens).tobytes(), 0)


def ngram_map_k_draft(
    index: NgramKeyIndex, history: np.ndarray, n_accepted: dict[bytes, int] | None = None, min_hits: int = 1
) -> tuple[np.ndarray, bytes | None]:
    """Sync `index` with `history` and draft; returns (draft, key used or None).

    `n_accepted` maps a key to the accepted length of its last chosen draft
    (missing = never used: draft `m` tokens).

    >>> ix = NgramKeyIndex(n=2, m=3)
    >>> h = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2], np.int32)
    >>> d, key = ngram_map_k_draft(ix, h); d
    array([3, 4, 5], dtype=int32)
    >>> ngram_map_k_draft(ix, h, {key: 1})[0]     # last time only 1 was accepted
    array([3], dtype=int32)
    """
    h = as_tokens(history)
    index.sync(h)
    n = index.n
    if len(h) <= n:
        return EMPTY_DRAFT, None
    key = h[len(h) - n :].tobytes()
    j = index.first.get(key)
    if j is None or index.counts[key] < min_hits:
        return EMPTY_DRAFT, None
    k = index.m if n_accepted is None else n_accepted.get(key, index.m)
    k = min(index.m, k)
    return h[j + n : j + n + k].copy(), key


@dataclass
class _SeqState:
    index: NgramKeyIndex
    n_accepted: dict[bytes, int] = field(default_factory=dict)
    last_key: bytes | None = None


class NgramMapKSpeculator(Speculator):
    """llama.cpp `ngram-map-k`: per-sequence n-gram index with per-key adaptive draft length."""

    name = "ngram_map_k"

    def __init__(self, params: NgramMapKParams | None = None) -> None:
        super().__init__()
        self.params = params or NgramMapKParams()
        self._seqs: dict[int, _SeqState] = {}

    def _new_state(self) -> _SeqState:
        return _SeqState(NgramKeyIndex(self.params.size_n, self.params.size_m))

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
        d, st.last_key = ngram_map_k_draft(st.index, h, st.n_accepted, self.params.min_hits)
        if not len(d):
            st.last_key = None
        return d

    def _accept(self, seq_id: int, n_drafted: int, n_accepted: int, winner: bool) -> None:
        st = self._seqs.get(seq_id)
        if st is None or not winner or st.last_key is None:
            return
        st.n_accepted[st.last_key] = int(n_accepted)
        st.last_key = None

    def _end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
