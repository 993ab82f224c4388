"""Hidden-state rows from the target to a hidden-state speculator (mtp, eagle3): the record and its routing.

Per round, the target decodes every sequence's rows (prompt chunk, or last
token + draft) and keeps the committed ones (the chunk, or last token +
accepted draft tokens). For sequences whose speculators need them, it also
keeps those rows' hidden states: one `HiddenRows` record per round, packed
into ONE float32 matrix (one buffer to ship: zero-copy through Ray's object
store, one device buffer for CUDA IPC):

    rows[offsets[i]:offsets[i+1]]   hidden rows of sequence seq_ids[i]
    tokens[...same...]              the committed tokens they belong to
                                    (row j: the state after tokens[j], at
                                    position pos0[i] + j)

What a row is depends on the taps the target was asked for, concatenated in
order: "nextn" (the target's final hidden state, llama.cpp's h_nextn: what an
MTP head reads) and layer ids (the input of that target layer: EAGLE-3 reads
three of them). A speculator takes its columns (`HiddenRows.columns`).

A speculator receives the record (`take`) and then, per sequence, the
scheduler's `process(seq, tokens, pos)` for the same committed tokens;
`RowStash` matches the two by sequence, position and token ids, so rows that
belong to another sequence, or arrive out of order, are detected instead of
silently mixed (a llama.cpp MTP implementation mixed rows across slots so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: the target's final hidden state (llama.cpp h_nextn), what an MTP head reads
TAP_NEXTN = "nextn"
Tap = int | str
ROW_DTYPE = np.float32


class RowMismatch(ValueError):
    """Rows for a sequence do not line up with the tokens the target committed."""


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows of a round: rows[j] is the state after tokens[j], at position pos0 + j."""

    seq_id: int
    pos0: int
    tokens: np.ndarray  # int32 [n]
    rows: np.ndarray  # float32 [n, width]

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.pos0, self.pos0 + len(self.tokens), dtype=np.int32)


@dataclass
class HiddenRows:
    """The hidden rows of one target round, all sequences packed into one matrix."""

    round_id: int
    taps: tuple[Tap, ...]
    tap_widths: tuple[int, ...]
    seq_ids: np.ndarray  # int32 [k]
    pos0: np.ndarray  # int32 [k]
    offsets: np.ndarray  # int64 [k + 1]
    tokens: np.ndarray  # int32 [N]
    rows: np.ndarray  # float32 [N, sum(tap_widths)]

    @property
    def width(self) -> int:
        return int(sum(self.tap_widths))

    @property
    def n_rows(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0

    @property
    def nbytes(self) -> int:
        """Bytes of hidden rows (the payload; the index arrays are a few bytes per sequence)."""
        return int(self.rows.nbytes)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def owned(self) -> "HiddenRows":
        """The record with arrays of its own (views into a buffer someone else must reuse are copied).

        >>> import numpy as np
        >>> buf = np.zeros(6, dtype=np.float32)
        >>> r = HiddenRows(0, (), (3,), np.zeros(1, np.int32), np.zeros(1, np.int32), np.array([0, 2]),
        ...                np.zeros(2, np.int32), buf.reshape(2, 3))
        >>> o = r.owned(); buf[:] = 1
        >>> float(o.rows.sum()), o.rows.base is None
        (0.0, True)
        """
        return HiddenRows(self.round_id, self.taps, self.tap_widths, np.array(self.seq_ids), np.array(self.pos0),
                          np.array(self.offsets), np.array(self.tokens), np.array(self.rows))

    def columns(self, taps: tuple[Tap, ...]) -> slice:
        """The column range of `taps` (which must be consecutive taps of this record, in order)."""
        starts = np.concatenate([[0], np.cumsum(self.tap_widths)]).astype(int)
        try:
            i = self.taps.index(taps[0])
        except ValueError:
            raise RowMismatch(f"the target sends taps {self.taps}, not {taps[0]!r}") from None
        if tuple(self.taps[i : i + len(taps)]) != tuple(taps):
            raise RowMismatch(f"taps {taps} are not consecutive in the record's taps {self.taps}")
        return slice(int(starts[i]), int(starts[i + len(taps)]))

    def select(self, taps: tuple[Tap, ...]) -> slice | np.ndarray:
        """The columns of `taps`, in that order: a slice where they are consecutive in the record (no copy),
        else column indices (a speculator whose taps another one's overlap: the target sends each tap once).

        >>> rec = HiddenRows(0, (2, 15, 27, 1), (2, 2, 2, 2), *[np.zeros(0)] * 5)
        >>> rec.select((15, 27)), rec.select((1, 15, 27)).tolist()
        (slice(2, 6, None), [6, 7, 2, 3, 4, 5])
        """
        try:
            return self.columns(taps)
        except RowMismatch:
            pass
        starts = np.concatenate([[0], np.cumsum(self.tap_widths)]).astype(int)
        missing = [t for t in taps if t not in self.taps]
        if missing:
            raise RowMismatch(f"the target sends taps {self.taps}, not {missing}")
        return np.concatenate([np.arange(starts[i], starts[i + 1]) for i in (self.taps.index(t) for t in taps)])

    def entry(self, i: int, cols: slice | np.ndarray | None = None) -> SeqRows:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        rows = self.rows[a:b] if cols is None else self.rows[a:b, cols]
        return SeqRows(int(self.seq_ids[i]), int(self.pos0[i]), self.tokens[a:b], rows)

    def entries(self, cols: slice | np.ndarray | None = None):
        for i in range(len(self.seq_ids)):
            yield self.entry(i, cols)

    def for_seq(self, seq_id: int) -> SeqRows | None:
        hit = np.flatnonzero(self.seq_ids == seq_id)
        return self.entry(int(hit[0])) if len(hit) else None

    def validate(self) -> None:
        """Raise RowMismatch unless the arrays are consistent (a record from another process)."""
        k = len(self.seq_ids)
        if len(self.pos0) != k or len(self.offsets) != k + 1 or (k and self.offsets[0] != 0):
            raise RowMismatch(f"inconsistent record: {k} sequences, {len(self.pos0)} pos0, {len(self.offsets)} offsets")
        if np.any(np.diff(self.offsets) < 0) or len(self.tokens) != self.n_rows:
            raise RowMismatch("inconsistent record: offsets do not cover the tokens")
        if self.rows.ndim != 2 or self.rows.shape != (self.n_rows, self.width):
            raise RowMismatch(f"rows of shape {self.rows.shape}, expected ({self.n_rows}, {self.width})")
        if len(set(self.seq_ids.tolist())) != k:
            raise RowMismatch("a sequence appears twice in one round's record")


def pack_rows(round_id: int, taps: tuple[Tap, ...], tap_widths: tuple[int, ...],
              entries: list[tuple[int, int, np.ndarray, np.ndarray]]) -> HiddenRows:
    """One record from (seq_id, pos0, tokens, rows) per sequence; rows are copied into one matrix."""
    width = int(sum(tap_widths))
    n = sum(len(t) for _, _, t, _ in entries)
    rows = np.empty((n, width), dtype=ROW_DTYPE)
    tokens = np.empty(n, dtype=np.int32)
    offsets = np.zeros(len(entries) + 1, dtype=np.int64)
    o = 0
    for i, (_, _, toks, r) in enumerate(entries):
        if len(r) != len(toks):
            raise RowMismatch(f"{len(r)} rows for {len(toks)} tokens")
        rows[o : o + len(toks)] = r
        tokens[o : o + len(toks)] = toks
        o += len(toks)
        offsets[i + 1] = o
    return HiddenRows(round_id, tuple(taps), tuple(int(w) for w in tap_widths),
                      np.array([e[0] for e in entries], dtype=np.int32),
                      np.array([e[1] for e in entries], dtype=np.int32), offsets, tokens, rows)


@dataclass
class RowStash:
    """Rows taken from records, per sequence, until process() commits their tokens.

    `take` files each entry of a record under its sequence; `pop(seq, tokens, pos)` returns the rows of
    exactly those committed tokens or raises RowMismatch (missing, wrong position, wrong tokens)."""

    pending: dict[int, list[SeqRows]] = field(default_factory=dict)
    taken: int = 0  # entries taken
    stale: int = 0  # entries dropped unused (their sequence ended, or a later position was committed)

    def take(self, record: HiddenRows, cols: slice | np.ndarray | None = None) -> None:
        for e in record.entries(cols):
            self.pending.setdefault(e.seq_id, []).append(e)
            self.taken += 1

    def pop(self, seq_id: int, tokens: np.ndarray, pos: int) -> np.ndarray:
        chunks = self.pending.get(seq_id)
        if not chunks:
            raise RowMismatch(f"no hidden rows for sequence {seq_id} at position {pos}")
        # older chunks than this commit were never processed (a round the scheduler did not mirror)
        while chunks and chunks[0].pos0 < pos:
            chunks.pop(0)
            self.stale += 1
        if not chunks:
            del self.pending[seq_id]
            raise RowMismatch(f"no hidden rows for sequence {seq_id} at position {pos}")
        e = chunks[0]
        if e.pos0 != pos:
            raise RowMismatch(f"sequence {seq_id}: rows start at position {e.pos0}, tokens were committed at {pos}")
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(e.tokens) != len(tokens) or not np.array_equal(e.tokens, tokens):
            raise RowMismatch(f"sequence {seq_id} at position {pos}: rows belong to tokens "
                              f"{e.tokens[:8].tolist()}..., committed {tokens[:8].tolist()}...")
        chunks.pop(0)
        if not chunks:
            del self.pending[seq_id]
        return e.rows

    def drop(self, seq_id: int) -> None:
        self.stale += len(self.pending.pop(seq_id, ()))


def mtp_input_rows(rows: np.ndarray, prev_row: np.ndarray) -> np.ndarray:
    """MTP pairs token x_q with the target's hidden state after x_{q-1}: for a committed chunk at positions
    p..p+n-1 with rows h_p..h_{p+n-1}, the head's input rows are [h_{p-1}, h_p, ..., h_{p+n-2}].

    >>> mtp_input_rows(np.array([[1.], [2.], [3.]]), np.array([0.])).ravel().tolist()
    [0.0, 1.0, 2.0]
    """
    out = np.empty_like(rows)
    out[0] = prev_row
    out[1:] = rows[:-1]
    return out
