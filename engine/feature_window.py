"""The `dflash` speculator's per-sequence window of target features, and the KV edits that keep it true.

A DFlash draft keeps the target's feature rows (the inputs of the layers it
declares) for a sequence's committed positions in its own KV cache, one cell
per position, injected in a decode; its block decode attends them. The window
is the bookkeeping of which positions those are, in pure Python:

    lo <= injected <= end
    [lo, injected)    rows in the draft's KV cache
    [injected, end)   rows received, waiting for the next injection decode
    end               the next committed position: where the next block's
                      anchor (the last sampled token) goes

Every change returns the KV edits (`KvOp`) the caller applies to the draft
context, so the cache and the window cannot drift apart silently:

- `append` (acceptance: the target committed tokens, with their rows);
- `trim` (rejection: positions from `pos` on are no longer the target's);
- `shift` (context shift: llama.cpp's n_keep / n_discard, positions after
  the discarded span move down);
- a `size` bound keeps only the last `size` positions (older cells leave).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KvOp:
    """An edit of one sequence's draft KV cells: "rm" removes positions [p0, p1); "add" moves positions
    [p0, p1) by `delta` (llama.cpp's seq_add, which re-ropes the keys)."""

    kind: str
    p0: int
    p1: int
    delta: int = 0


@dataclass
class _Chunk:
    pos0: int
    rows: np.ndarray

    @property
    def end(self) -> int:
        return self.pos0 + len(self.rows)


def _cut(chunks: list[_Chunk], p0: int, p1: int) -> list[_Chunk]:
    """Chunks without positions [p0, p1).

    >>> [(c.pos0, len(c.rows)) for c in _cut([_Chunk(0, np.zeros((4, 1))), _Chunk(4, np.zeros((2, 1)))], 2, 5)]
    [(0, 2), (5, 1)]
    """
    out = []
    for c in chunks:
        if c.pos0 < p0:
            out.append(_Chunk(c.pos0, c.rows[: min(len(c.rows), p0 - c.pos0)]))
        if c.end > p1:
            a = max(p1, c.pos0)
            out.append(_Chunk(a, c.rows[a - c.pos0 :]))
    return [c for c in out if len(c.rows)]


@dataclass
class FeatureWindow:
    """One sequence's target feature rows, by position (see the module docstring).

    >>> w = FeatureWindow()
    >>> w.append(0, np.zeros((5, 2)))                      # the prompt's 5 rows arrive
    []
    >>> pos0, rows = w.take_pending(); (pos0, len(rows), w.injected, w.end)
    (0, 5, 5, 5)
    >>> w.append(5, np.zeros((3, 2)))                      # last token + 2 accepted draft tokens
    []
    >>> w.trim(6)                                          # a rollback: the target kept only position 5
    []
    >>> (w.injected, w.end, w.pending)
    (5, 6, 1)
    >>> w.take_pending()[0], w.injected
    (5, 6)
    >>> w.shift(2, 3)                                      # context shift: keep 2, drop 3, the rest moves down
    [KvOp(kind='rm', p0=2, p1=5, delta=0), KvOp(kind='add', p0=5, p1=6, delta=-3)]
    >>> (w.lo, w.injected, w.end)
    (0, 3, 3)
    """

    size: int | None = None  # keep at most this many positions (None: all)
    lo: int = 0
    injected: int = 0
    end: int = 0
    chunks: list[_Chunk] = field(default_factory=list)  # the pending rows, [injected, end) in order

    @property
    def pending(self) -> int:
        return self.end - self.injected

    def __len__(self) -> int:
        return self.end - self.lo

    def append(self, pos: int, rows: np.ndarray) -> list[KvOp]:
        """Rows of the tokens the target committed at positions pos.. (pos must be `end`)."""
        if pos != self.end:
            raise ValueError(f"rows at position {pos}, the window ends at {self.end}")
        if len(rows):
            self.chunks.append(_Chunk(pos, rows))
            self.end += len(rows)
        return self._bound()

    def _bound(self) -> list[KvOp]:
        """Drop the positions before end - size (their cells leave the cache)."""
        if self.size is None or len(self) <= self.size:
            return []
        lo = self.end - self.size
        ops = [KvOp("rm", self.lo, min(lo, self.injected))] if self.lo < min(lo, self.injected) else []
        self.chunks = _cut(self.chunks, self.lo, lo)
        self.lo = lo
        self.injected = max(self.injected, lo)
        return ops

    def trim(self, pos: int) -> list[KvOp]:
        """Forget positions pos.. (the target no longer holds them)."""
        if pos >= self.end:
            return []
        ops = [KvOp("rm", max(pos, self.lo), self.injected)] if self.injected > max(pos, self.lo) else []
        self.chunks = _cut(self.chunks, pos, self.end)
        self.end = pos
        self.injected = min(self.injected, pos)
        self.lo = min(self.lo, pos)
        return ops

    def shift(self, n_keep: int, n_discard: int) -> list[KvOp]:
        """The target's context shift: positions [n_keep, n_keep + n_discard) are dropped and the later ones
        move down by n_discard (what llama.cpp's seq_rm + seq_add do to the target's own cache).

        >>> w = FeatureWindow(lo=10, injected=20, end=24)   # a bounded window: positions 10..23, 4 pending
        >>> w.chunks = [_Chunk(20, np.zeros((4, 1)))]
        >>> w.shift(4, 12)                                  # 4..15 go: the cells 10..15 too, 16..19 move to 4..7
        [KvOp(kind='rm', p0=10, p1=16, delta=0), KvOp(kind='add', p0=16, p1=20, delta=-12)]
        >>> (w.lo, w.injected, w.end, w.chunks[0].pos0)
        (4, 8, 12, 8)
        """
        if n_discard <= 0 or n_keep >= self.end:
            return []
        cut_end = n_keep + n_discard
        ops = []
        rm0, rm1 = max(n_keep, self.lo), min(cut_end, self.injected)
        if rm0 < rm1:
            ops.append(KvOp("rm", rm0, rm1))
        if self.injected > max(cut_end, self.lo):
            ops.append(KvOp("add", max(cut_end, self.lo), self.injected, -n_discard))
        self.chunks = [_Chunk(c.pos0 - n_discard if c.pos0 >= cut_end else c.pos0, c.rows)
                       for c in _cut(self.chunks, n_keep, cut_end)]

        def moved(p: int) -> int:
            return p if p <= n_keep else max(n_keep, p - n_discard)

        self.lo, self.injected, self.end = moved(self.lo), moved(self.injected), moved(self.end)
        return ops

    def take_pending(self) -> tuple[int, np.ndarray]:
        """(first position, rows) of the rows waiting for injection, as one matrix; they count as injected."""
        pos0 = self.injected
        rows = (np.concatenate([c.rows for c in self.chunks]) if len(self.chunks) > 1
                else self.chunks[0].rows if self.chunks else np.zeros((0, 0), dtype=np.float32))
        self.chunks = []
        self.injected = self.end
        return pos0, rows

    def undo_take(self, pos0: int, rows: np.ndarray) -> None:
        """Put rows taken with take_pending back (their injection failed; the caller removed its cells)."""
        if len(rows):
            self.chunks = [_Chunk(pos0, rows), *self.chunks]
        self.injected = pos0

    def reset(self) -> None:
        self.lo = self.injected = self.end = 0
        self.chunks = []
