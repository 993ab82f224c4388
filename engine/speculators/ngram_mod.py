"""ngram_mod: a fixed pool mapping a hash of the last n_match tokens to the next token.

Mirrors llama.cpp's `common_ngram_mod` (common/ngram-mod.cpp) and
`common_speculative_impl_ngram_mod` (common/speculative.cpp):

* one pool of `pool_size` int32 entries (-1 = empty), shared by all sequences
  of the speculator, allocated with the speculator (as llama.cpp does): the
  page faults of a fresh pool's first use would otherwise fall on the first
  admission round, and on every sequence decoding in it;
* slot of an n-gram = (sum_i t_i * C**(n-1-i) mod 2**64) mod pool_size with
  C = 6364136223846793005 (llama.cpp's `idx`); `add` stores the token that
  followed the n-gram, overwriting (no collision check: a collision makes a
  wrong draft token, which the target rejects);
* `begin` adds the prompt's n-grams; if the pool is then more than 25 % full it
  is reset (the whole pool);
* each draft first adds the sequence's new n-grams, in chunks: only once more
  than 32 new tokens have arrived since the last add (history[:-1] only);
* drafting rolls the hash forward token by token from the last n_match tokens
  of the history, up to n_max tokens; a miss before n_min tokens means no
  draft, a later miss ends the draft;
* on accept (winner only): a draft with accepted/drafted < 0.25 counts as a
  low-acceptance round; after 5 consecutive ones the pool is reset.

One adaptation: the draft limit is min(n_max, request's n_max), and a miss
only voids the draft if it comes before min(n_min, that limit) tokens, so a
server asking for 16 tokens still gets 16-token drafts with n_min = 48.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.speculator import DraftRequest, Speculator

from ._util import EMPTY_DRAFT, HistoryCursor, as_tokens

try:  # the compiled core of NgramModPool.add_range and .roll (setup.py builds it; _ngram_mod_core.c)
    from ._ngram_mod_core import add as _core_add
    from ._ngram_mod_core import roll as _core_roll
except ImportError:  # not built: the references run, with the same results
    _core_add = _core_roll = None

#: whether NgramModPool.add_range and .roll run compiled here
COMPILED_CORE = _core_add is not None

HASH_MUL = 6364136223846793005
MASK64 = (1 << 64) - 1
EMPTY = -1
ADD_CHUNK = 32  # new tokens gathered before they are added (llama.cpp)
OCCUPANCY_RESET = 0.25  # pool reset after begin if more than this fraction is used
LOW_ACCEPT_FRAC = 0.25  # a round with accepted/drafted below this is "low"
LOW_ACCEPT_STREAK = 5  # this many low rounds in a row reset the pool


class NgramModParams(BaseModel):
    """Parameters of ngram_mod (llama.cpp `common_params_speculative_ngram_mod` defaults)."""

    model_config = ConfigDict(extra="forbid")

    n_match: int = Field(24, ge=1, le=1024, description="n-gram length hashed into the pool")
    n_min: int = Field(48, ge=0, le=4096, description="a pool miss before this many draft tokens means no draft")
    n_max: int = Field(64, ge=1, le=4096, description="at most this many draft tokens")
    pool_size: int = Field(
        4 * 1024 * 1024, ge=1, le=1 << 31, description="pool entries (int32 each; 4M = 16 MiB), allocated with the speculator"
    )


class NgramModPool:
    """The hash pool (llama.cpp `common_ngram_mod`), with vectorised bulk adds.

    >>> pool = NgramModPool(n=2, size=1021)
    >>> pool.add_range(np.array([1, 2, 3, 1, 2, 4], np.int32), 0, 4)   # n-grams at 0..3
    >>> pool.get(np.array([1, 2], np.int32)), pool.get(np.array([2, 3], np.int32))
    (4, 1)
    >>> pool.get(np.array([9, 9], np.int32)), pool.used
    (-1, 3)
    """

    #: add_range and roll with the compiled core where it is built; False (on the class) runs the references
    compiled = True

    def __init__(self, n: int, size: int, allocate: bool = False) -> None:
        """allocate: the table now (size int32 slots), not at the first add."""
        self.n = int(n)
        self.size = int(size)
        self.entries: np.ndarray | None = None  # allocated on first add (or now: allocate)
        self.used = 0
        # C**(n-1-i) mod 2**64 for i in 0..n-1
        pw = [pow(HASH_MUL, self.n - 1 - i, 1 << 64) for i in range(self.n)]
        self._powers = np.array(pw, dtype=np.uint64)
        self._top = pw[0]  # C**(n-1): weight of the token leaving the window
        if allocate:
            self._alloc()

    def _alloc(self) -> np.ndarray:
        if self.entries is None:
            self.entries = np.full(self.size, EMPTY, dtype=np.int32)
            self.used = 0
        return self.entries

    def reset(self) -> None:
        if self.entries is not None:
            self.entries.fill(EMPTY)
        self.used = 0

    @property
    def occupancy(self) -> float:
        return self.used / self.size

    def hash(self, window) -> int:
        h = 0
        for t in window:
            h = (h * HASH_MUL + int(t)) & MASK64
        return h

    def get(self, window: np.ndarray) -> int:
        if self.entries is None:
            return EMPTY
        return int(self.entries[self.hash(window) % self.size])

    def add_range(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """add(tokens[i:i+n] -> tokens[i+n]) for i in [start, stop), in order (later wins). Runs the compiled core
        (_ngram_mod_core.c) where it is built and `compiled` is on, else `add_range_reference`: the two write the
        same slots with the same tokens and count the same slots newly used."""
        if _core_add is None or not self.compiled:
            self.add_range_reference(tokens, start, stop)
            return
        stop = min(stop, len(tokens) - self.n)
        if stop <= start:
            return
        self.used += _core_add(self._alloc(), np.ascontiguousarray(tokens, dtype=np.int32), start, stop, self.n)

    def add_range_reference(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """`add_range` in numpy: every window hashed afresh, the last write of each slot kept. The reference the
        compiled core is held to (tests/unit/test_spec_ngram_mod_core.py), and what runs where it is not built.

        >>> a, b = NgramModPool(n=2, size=7), NgramModPool(n=2, size=7)
        >>> toks = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
        >>> a.add_range(toks, 0, 6); b.add_range_reference(toks, 0, 6)
        >>> a.entries.tolist() == b.entries.tolist(), a.used == b.used
        (True, True)
        """
        n = self.n
        stop = min(stop, len(tokens) - n)
        if stop <= start:
            return
        entries = self._alloc()
        t = tokens[start : stop + n - 1].astype(np.uint64)
        # hashes of all windows; uint64 arithmetic wraps mod 2**64 like size_t
        with np.errstate(over="ignore"):
            h = (sliding_window_view(t, n) * self._powers).sum(axis=1, dtype=np.uint64)
        idx = (h % np.uint64(self.size)).astype(np.int64)
        vals = tokens[start + n : stop + n]
        # keep the last add of every slot, as sequential adds would
        uniq, rev_first = np.unique(idx[::-1], return_index=True)
        last = len(idx) - 1 - rev_first
        self.used += int(np.count_nonzero(entries[uniq] == EMPTY))
        entries[uniq] = vals[last]

    def push(self, h: int, t_out: int, t_in: int) -> int:
        """Hash of the window shifted by one token (t_out leaves, t_in enters)."""
        return ((h - t_out * self._top) * HASH_MUL + t_in) & MASK64

    def roll(self, start_window, limit: int, n_min: int, h: int | None = None) -> list[int]:
        """Draft by rolling the hash: up to `limit` tokens; [] on a miss before `n_min`. Runs the compiled core
        (_ngram_mod_core.c) where it is built and `compiled` is on, which hashes the window itself; else
        `roll_reference`, which uses `h`, the hash of `start_window`, where the caller has it. The two draft the
        same tokens."""
        if _core_roll is None or not self.compiled:
            return self.roll_reference(start_window, limit, n_min, h)
        if self.entries is None or limit <= 0:
            return []
        return _core_roll(self.entries, np.ascontiguousarray(start_window, dtype=np.int32), limit, n_min)

    def roll_reference(self, start_window, limit: int, n_min: int, h: int | None = None) -> list[int]:
        """`roll` in Python: the reference the compiled core is held to (tests/unit/test_spec_ngram_mod_core.py), and
        what runs where it is not built. `h` may pass the hash of `start_window` if the caller already has it.

        >>> pool = NgramModPool(n=2, size=97)
        >>> pool.add_range(np.array([1, 2, 3, 4, 1, 2, 5], np.int32), 0, 5)
        >>> pool.roll_reference([1, 2], 3, 1), pool.roll([1, 2], 3, 1)   # [1 2] -> 5 (the later add), [2 5]: none
        ([5], [5])
        """
        entries = self.entries
        if entries is None or limit <= 0:
            return []
        size, top, mul = self.size, self._top, HASH_MUL
        if h is None:
            h = self.hash(start_window)
        if entries[h % size] == EMPTY:  # the common case: no draft
            return []
        seq = [int(t) for t in start_window]
        out: list[int] = []
        for i in range(limit):
            tok = int(entries[h % size])
            if tok == EMPTY:
                if i < n_min:
                    return []
                break
            out.append(tok)
            seq.append(tok)
            h = ((h - seq[i] * top) * mul + tok) & MASK64
        return out


def ngram_mod_draft(
    pool: NgramModPool, history: np.ndarray, n_max: int = 64, n_min: int = 48, h: int | None = None
) -> np.ndarray:
    """Draft from `pool` after `history` (no pool update). See the module doc.

    `h`, if given, is the hash of the last n tokens of `history` (a caller
    tracking it incrementally saves recomputing it).

    >>> pool = NgramModPool(n=2, size=4093)
    >>> h = np.array([5, 1, 2, 3, 4, 6, 1, 2], np.int32)
    >>> pool.add_range(h[:-1], 0, len(h) - 1)
    >>> ngram_mod_draft(pool, h, n_max=3, n_min=2)     # [1 2] -> 3, [2 3] -> 4, [3 4] -> 6
    array([3, 4, 6], dtype=int32)
    >>> ngram_mod_draft(pool, h, n_max=8, n_min=2)     # [4 6] -> 1, then [6 1] is not in the pool
    array([3, 4, 6, 1], dtype=int32)
    >>> ngram_mod_draft(pool, h, n_max=8, n_min=5)     # miss after 4 < n_min tokens: no draft
    array([], dtype=int32)
    >>> ngram_mod_draft(pool, np.array([9, 9, 1], np.int32), n_max=4, n_min=1)
    array([], dtype=int32)
    """
    hist = as_tokens(history)
    n = pool.n
    if len(hist) < n + 1 or n_max <= 0:
        return EMPTY_DRAFT
    if pool.entries is None:
        return EMPTY_DRAFT
    out = pool.roll(hist[len(hist) - n :], n_max, min(n_min, n_max), h)
    return np.array(out, dtype=np.int32) if out else EMPTY_DRAFT


@dataclass
class _SeqInfo:
    i_last: int = 0  # n-grams starting before this position of history[:-1] were added
    n_low: int = 0  # consecutive low-acceptance rounds
    cursor: HistoryCursor = field(default_factory=HistoryCursor)
    # rolling hashes: hashes[k] = pool hash of history[e - n : e] for e = hbase + k
    hashes: list[int] = field(default_factory=list)
    hbase: int = 0


MAX_ROLL = 64  # more new tokens than this in one call: hash afresh, add with numpy


class NgramModSpeculator(Speculator):
    """llama.cpp `ngram-mod`: shared rolling-hash pool, reset after low-acceptance streaks.

    Per sequence it keeps the rolling hash of the last n_match tokens and the
    hashes of the windows not yet added, so each call costs O(new tokens).
    """

    name = "ngram_mod"

    def __init__(self, params: NgramModParams | None = None) -> None:
        super().__init__()
        self.params = params or NgramModParams()
        # allocated here, not in the first round that adds (see the module docstring)
        self.pool = NgramModPool(self.params.n_match, self.params.pool_size, allocate=True)
        self._seqs: dict[int, _SeqInfo] = {}
        self.n_resets = 0  # pool resets (occupancy or low acceptance)

    def _reset_pool(self) -> None:
        self.pool.reset()
        self.n_resets += 1

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        info = self._seqs[seq_id] = _SeqInfo()
        n = self.pool.n
        if len(prompt) < n:
            return
        self.pool.add_range(prompt, 0, len(prompt) - n)
        info.i_last = len(prompt) - n
        info.cursor.advance(prompt)
        if self._keeps_hashes():
            info.hashes = [self.pool.hash(prompt[len(prompt) - n :])]
            info.hbase = len(prompt)
        if self.pool.occupancy > OCCUPANCY_RESET:
            self._reset_pool()

    def _keeps_hashes(self) -> bool:
        """Whether each sequence keeps its windows' hashes up to date (_roll_hashes): the interpreted roll and
        add read them instead of hashing again; the compiled core hashes a window in fewer steps than keeping
        its hash costs."""
        return _core_roll is None or not self.pool.compiled

    def _roll_hashes(self, info: _SeqInfo, h: np.ndarray) -> int:
        """Bring info.hashes up to the window ending at len(h); returns that window's hash."""
        pool, n, L = self.pool, self.pool.n, len(h)
        hs = info.hashes
        e_last = info.hbase + len(hs) - 1
        if hs and e_last <= L and L - e_last <= MAX_ROLL:
            if e_last < L:
                hv = hs[-1]
                seg = h[e_last - n : L].tolist()  # tokens leaving / entering
                for k in range(L - e_last):
                    hv = pool.push(hv, seg[k], seg[k + n])
                    hs.append(hv)
            return hs[-1]
        hv = pool.hash(h[L - n :].tolist())
        info.hashes, info.hbase = [hv], L
        return hv

    def _add_new(self, info: _SeqInfo, h: np.ndarray, cur_len: int) -> None:
        """Add n-grams i in [i_last, cur_len - n) of history[:cur_len] (llama.cpp's chunked add)."""
        pool, n = self.pool, self.pool.n
        lo, hi = info.i_last + n, cur_len  # window ends e = i + n, next token h[e]
        if self._keeps_hashes() and info.hbase <= lo and pool.entries is not None:
            entries, size, hs, base = pool.entries, pool.size, info.hashes, info.hbase
            nxt = h[lo:hi].tolist()
            used = 0
            for k, e in enumerate(range(lo, hi)):
                idx = hs[e - base] % size
                if entries[idx] == EMPTY:
                    used += 1
                entries[idx] = nxt[k]
            pool.used += used
        else:
            pool.add_range(h[:cur_len], info.i_last, cur_len - n)
        info.i_last = cur_len - n
        if info.hbase < cur_len:  # drop hashes no longer needed
            del info.hashes[: cur_len - info.hbase]
            info.hbase = cur_len

    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        info = self._seqs.get(req.seq_id)
        if info is None:
            info = self._seqs[req.seq_id] = _SeqInfo()
        h = as_tokens(req.history)
        if not info.cursor.is_extension(h):
            info.i_last = 0  # other tokens than before: re-add from the start
            info.n_low = 0
            info.hashes = []
        info.cursor.advance(h)
        pool = self.pool
        n = pool.n
        L = len(h)
        cur_len = L - 1  # llama.cpp's prompt = history[:-1]
        if cur_len < n:
            return EMPTY_DRAFT
        hv = self._roll_hashes(info, h) if self._keeps_hashes() else None
        if info.i_last + ADD_CHUNK < cur_len:
            self._add_new(info, h, cur_len)
        if pool.entries is None:
            return EMPTY_DRAFT
        limit = min(self.params.n_max, req.n_max)
        out = pool.roll(h[L - n :], limit, min(self.params.n_min, limit), hv)
        return np.array(out, dtype=np.int32) if out else EMPTY_DRAFT

    def _accept(self, seq_id: int, n_drafted: int, n_accepted: int, winner: bool) -> None:
        if not winner or n_drafted <= 0:
            return
        info = self._seqs.get(seq_id)
        if info is None:
            return
        if n_accepted / n_drafted < LOW_ACCEPT_FRAC:
            info.n_low += 1
            if info.n_low >= LOW_ACCEPT_STREAK:
                self._reset_pool()
                info.n_low = 0
                info.i_last = 0
        else:
            info.n_low = 0

    def _end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def get_state(self):
        e = self.pool.entries
        # an empty pool travels as None, not as 16 MiB of -1
        return {"entries": None if e is None or not self.pool.used else e.copy(), "used": self.pool.used}

    def set_state(self, state) -> None:
        if not state:
            return
        e = state.get("entries")
        if e is None:  # an empty pool (get_state): this one empties too
            self.pool.reset()
        elif len(e) == self.pool.size:
            self.pool.entries = np.array(e, dtype=np.int32)
            self.pool.used = int(state.get("used", 0))
