"""dflash: a DFlash block-diffusion draft proposes a whole block of tokens per sequence in ONE decode.

As llama.cpp's `draft-dflash` (common/speculative.cpp), with parallel slots:
the draft keeps, per sequence, the target's feature rows (the inputs of the
target layers it declares, concatenated) in its own KV cache, one cell per
committed position, injected by an embedding decode (its fc fusion and K/V
projections); the block [last sampled token, <mask> x n] at the next positions
is decoded with non-causal attention over those cells and the block itself,
and the predictions at the n mask positions are the draft. ONE injection
decode and ONE block decode serve every drafting sequence; then the block's
cells leave the cache. A DFlash2 draft (a selector over the top-k candidates
of each block position) is read the same way by its backend.

Which positions the cache holds per sequence is `FeatureWindow`'s business
(engine/feature_window.py): rows appended as the target commits (the RowStash
checks their sequence, positions and tokens, as for mtp / eagle3), trimmed
when a commit restarts at an earlier position, shifted on a context shift.
The model is behind `DFlashBackend` (native/dflash_backend.py); this module
has no llama.cpp import.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import Field

from specray.engine.cost import DecodeCostModel
from specray.engine.feature_window import FeatureWindow, KvOp
from specray.engine.hidden_rows import HiddenRows, RowStash, Tap
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE, DraftRequest

from .draft import TokenBuffer
from .draft_base import ModelDraftParams, ModelSpeculator
from .hidden_base import RowMirror

log = logging.getLogger("specray.dflash")


class DFlashParams(ModelDraftParams):
    """Parameters of the `dflash` speculator."""

    n_max: int = Field(
        15, ge=1, le=64, description="draft tokens per sequence per round at most; one block decode drafts them "
        "all, so this is capped at the draft's dflash.block_size - 1 (the cost policy cuts each draft further)")
    window: int | None = Field(
        None, ge=1, description="target feature positions kept per sequence in the draft's KV cache, the most "
        "recent ones (None: the whole context, as llama.cpp). Fewer: a cheaper block decode, less context")
    audit: bool = Field(
        False, description="keep every row received, by sequence and position (tests and diagnostics; memory grows "
        "with the context)")


class DFlashBackend(Protocol):
    """A DFlash draft context with one sequence per slot."""

    width: int  # feature row width (target layers x the target's n_embd)
    taps: tuple[Tap, ...]  # the target layers it reads, in column order
    block_size: int  # tokens of a block at most: the anchor + block_size - 1 drafted

    def inject(self, runs: list[tuple[int, int, np.ndarray]]) -> None:
        """Write the feature rows of runs (seq_id, pos0, rows [n, width]) into the cache at pos0..."""
        ...

    def draft_blocks(self, blocks: list[tuple[int, int, int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Decode blocks (seq_id, anchor position, anchor token, n): the anchor then n masks. Per block, n draft
        tokens and their probabilities. The blocks' cells stay in the cache (the caller removes them)."""
        ...

    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None: ...

    def kv_shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...

    def is_eog(self, token: int) -> bool: ...

    def decode_costs(self) -> dict[int, float]:
        """Seconds per block decode by its total tokens."""
        ...

    def inject_costs(self) -> dict[int, float]:
        """Seconds per injection decode by its rows."""
        ...


def block_draft_seconds(block: DecodeCostModel, inject: DecodeCostModel, n_seqs: int, n_steps: int,
                        rows_per_seq: float, overhead: float = 0.0) -> float:
    """What drafting n_steps tokens for n_seqs sequences costs: one injection decode of the rows committed since
    their last draft (rows_per_seq each, ~1 + accepted) and one block decode of (n_steps + 1) tokens each.

    >>> block = DecodeCostModel({1: 0.002, 16: 0.004, 32: 0.006})
    >>> inject = DecodeCostModel({1: 0.0005, 8: 0.001})
    >>> round(block_draft_seconds(block, inject, 4, 7, 2.0), 4)   # 8 rows injected, 4 blocks of 8 tokens
    0.007
    """
    n = max(1, n_seqs)
    return overhead + inject.cost(max(1, round(n * rows_per_seq))) + block.cost(n * (n_steps + 1))


@dataclass
class DFlashCounters:
    blocks: int = 0  # block decodes
    injections: int = 0  # injection decodes
    decode_seconds: float = 0.0
    inject_seconds: float = 0.0
    injected_rows: int = 0
    drafted_tokens: int = 0
    rows_taken: int = 0  # per-sequence entries taken from records
    records: int = 0
    row_bytes: int = 0  # bytes of the columns this speculator took
    trimmed: int = 0  # commits that restarted before the window's end (its tail left the cache)
    shifts: int = 0
    unsynced: int = 0  # draft requests for a sequence whose committed tokens the draft has not seen
    mismatched: int = 0  # commits whose rows were missing or belonged to other tokens/positions (RowMismatch)
    lost: int = 0  # sequences that stopped drafting because of that
    failures: int = 0  # injection or block decodes that failed


@dataclass
class _DSeq:
    window: FeatureWindow
    committed: TokenBuffer = field(default_factory=TokenBuffer)  # tokens the target committed (process)
    lost: bool = False  # rows went missing: the window cannot follow this sequence any more


class DFlashSpeculator(RowMirror, ModelSpeculator):
    name = "dflash"

    def __init__(self, params: DFlashParams | None, backend: DFlashBackend) -> None:
        super().__init__()
        self.params = params or DFlashParams()
        self.backend = backend
        self.n_block = max(1, min(self.params.n_max, backend.block_size - 1))  # draft tokens per block at most
        self.max_steps = self.n_block
        self.taps = tuple(backend.taps)
        self.seqs: dict[int, _DSeq] = {}
        self.stash = RowStash()
        self.counters = DFlashCounters()
        self.step_cost = DecodeCostModel(backend.decode_costs() or None, ema=0.1)  # block decodes
        self.inject_cost = DecodeCostModel(backend.inject_costs() or None, ema=0.1)
        self.rows_per_seq = 2.0  # rows injected per drafting sequence per draft call (EMA)
        self.overhead_seconds = 0.0
        self.audit: dict[int, dict[int, tuple[int, np.ndarray]]] = {}  # seq -> pos -> (token, row)

    # ---- cost ------------------------------------------------------------------------------------
    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        return block_draft_seconds(self.step_cost, self.inject_cost, n_seqs, min(n_steps, self.n_block),
                                   self.rows_per_seq, self.overhead_seconds)

    def catchup_seconds(self, seq_id: int, history) -> float:
        st = self.seqs.get(seq_id)
        rows = st.window.pending if st is not None else len(history)
        steady = max(1, round(self.rows_per_seq))
        return max(0.0, self.inject_cost.cost(rows) - self.inject_cost.cost(steady)) if rows > steady else 0.0

    # ---- sequence life ---------------------------------------------------------------------------
    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self._reset(seq_id)

    def _end(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.backend.kv_remove(seq_id, 0)
        self.stash.drop(seq_id)
        self.audit.pop(seq_id, None)

    def _reset(self, seq_id: int) -> _DSeq:
        st = self.seqs[seq_id] = _DSeq(FeatureWindow(size=self.params.window))
        self.backend.kv_remove(seq_id, 0)  # the slot may hold another sequence's cells
        self.stash.drop(seq_id)
        self.audit.pop(seq_id, None)
        return st

    def _apply(self, seq_id: int, ops: list[KvOp]) -> None:
        for op in ops:
            if op.kind == "rm":
                self.backend.kv_remove(seq_id, op.p0, op.p1)
            else:
                self.backend.kv_shift(seq_id, op.p0, op.p1, op.delta)

    def _lose(self, seq_id: int, st: _DSeq, why: str) -> None:
        if not st.lost:
            log.warning("dflash stops drafting for sequence %s: %s", seq_id, why)
            self.counters.lost += 1
        st.lost = True
        self.stash.drop(seq_id)

    def take_hidden(self, record: HiddenRows) -> None:
        """This round's rows from the target (all its sequences); process() then consumes them."""
        cols = record.select(self.taps)
        before = self.stash.taken
        self.stash.take(record, cols)
        self.counters.records += 1
        self.counters.rows_taken += self.stash.taken - before
        width = len(range(record.width)[cols]) if isinstance(cols, slice) else len(cols)
        self.counters.row_bytes += record.n_rows * width * record.rows.itemsize

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos...; their rows must be in the stash."""
        got = self._commit_rows(seq_id, tokens, pos)
        if got is None:
            return
        st, tokens, rows = got
        if pos > st.committed.n:
            self.counters.mismatched += 1
            self._lose(seq_id, st, f"tokens committed at {pos}, the window ends at {st.committed.n}")
            return
        if pos < st.committed.n:  # the target went back (its tail was rejected after all): so does the window
            self.counters.trimmed += 1
            self._apply(seq_id, st.window.trim(pos))
            st.committed.truncate(pos)
            if seq_id in self.audit:
                self.audit[seq_id] = {q: v for q, v in self.audit[seq_id].items() if q < pos}
        self._audit_rows(seq_id, tokens, pos, rows)
        st.committed.extend(tokens)
        self._apply(seq_id, st.window.append(pos, rows))

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """The target shifted seq_id's context (dropped positions [n_keep, n_keep + n_discard), moved the rest
        down): the window, its cells and the mirrored tokens follow."""
        st = self.seqs.get(seq_id)
        if st is None or n_discard <= 0:
            return
        self.counters.shifts += 1
        self._apply(seq_id, st.window.shift(n_keep, n_discard))
        kept = np.delete(st.committed.view(), np.s_[n_keep : n_keep + n_discard])
        st.committed = TokenBuffer()
        st.committed.extend(kept)
        self.stash.drop(seq_id)
        if seq_id in self.audit:
            self.audit[seq_id] = {p if p < n_keep else p - n_discard: v for p, v in self.audit[seq_id].items()
                                  if not n_keep <= p < n_keep + n_discard}

    def kv_tokens(self, seq_id: int) -> np.ndarray:
        """The committed tokens whose feature rows are in the draft's cache, by position from window.lo."""
        st = self.seqs.get(seq_id)
        return st.committed.view()[st.window.lo : st.window.injected].copy() if st else np.zeros(0, TOKEN_DTYPE)

    # ---- drafting -----------------------------------------------------------------------------------
    def _draft_one(self, req: DraftRequest) -> np.ndarray:  # pragma: no cover - draft() is batched
        return self.draft([req])[0]

    def _blocks(self, requests: list[DraftRequest]) -> list[tuple[int, DraftRequest, _DSeq, int]]:
        """The requests that can draft: (index, request, state, tokens to draft)."""
        todo = []
        for i, req in enumerate(requests):
            self.stats.calls += 1
            h = req.history
            n = min(self.n_block, req.n_max)
            if n <= 0 or len(h) == 0:
                continue
            st = self.seqs.get(req.seq_id)
            c = len(h) - 1
            if (st is None or st.lost or st.committed.n != c or c == 0 or st.window.end != c
                    or int(st.committed.buf[c - 1]) != int(h[c - 1])):
                self.counters.unsynced += 1
                continue
            todo.append((i, req, st, n))
        return todo

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        p = self.params
        out = [EMPTY_DRAFT] * len(requests)
        todo = self._blocks(requests)
        if not todo:
            self.stats.time_draft_s += time.perf_counter() - t0
            return out
        taken = [(req.seq_id, *st.window.take_pending()) for _, req, st, _ in todo]
        runs = [r for r in taken if len(r[2])]
        n_rows = sum(len(r[2]) for r in runs)
        self.rows_per_seq += 0.1 * (min(n_rows, 8 * len(todo)) / len(todo) - self.rows_per_seq)
        spent = 0.0
        try:
            if runs:
                ti = time.perf_counter()
                self.backend.inject(runs)
                dt = time.perf_counter() - ti
                self.inject_cost.observe(n_rows, dt)
                self.counters.injections += 1
                self.counters.inject_seconds += dt
                self.counters.injected_rows += n_rows
                spent += dt
        except Exception:
            # the cache may hold part of the rows: out again, and back to pending for the next call
            self.counters.failures += 1
            log.exception("dflash feature injection failed; no drafts this call")
            for (_, req, st, _), (seq, pos0, rows) in zip(todo, taken):
                self._clear_from(seq, pos0)
                st.window.undo_take(pos0, rows)
            self.stats.time_draft_s += time.perf_counter() - t0
            return out
        blocks = [(req.seq_id, st.window.end, int(req.history[-1]), n) for _, req, st, n in todo]
        try:
            td = time.perf_counter()
            results = self.backend.draft_blocks(blocks)
            dt = time.perf_counter() - td
            self.step_cost.observe(sum(b[3] + 1 for b in blocks), dt)
            self.counters.blocks += 1
            self.counters.decode_seconds += dt
            spent += dt
        except Exception:
            self.counters.failures += 1
            log.exception("dflash block decode failed; no drafts this call")
            results = None
        finally:
            for seq, pos, _, _ in blocks:  # the block's cells leave; the committed rows stay
                self._clear_from(seq, pos)
        if results is not None:
            for (i, req, st, n), (toks, probs) in zip(todo, results):
                d = self._cut(np.asarray(toks, dtype=TOKEN_DTYPE)[:n], np.asarray(probs)[:n])
                self.counters.drafted_tokens += len(d)
                if len(d) >= max(1, p.n_min):
                    out[i] = d
                    self.stats.drafts_generated += 1
        wall = time.perf_counter() - t0
        self.overhead_seconds += 0.1 * (max(0.0, wall - spent) - self.overhead_seconds)
        self.stats.time_draft_s += wall
        return out

    def _clear_from(self, seq_id: int, pos: int) -> None:
        try:
            self.backend.kv_remove(seq_id, pos)
        except Exception:
            log.exception("clearing the dflash cache of sequence %s from %s failed", seq_id, pos)

    def _cut(self, toks: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The draft up to the first token under p_min (excluded) or the first end-of-generation (included)."""
        n = len(toks)
        low = np.flatnonzero(probs < self.params.p_min)
        if len(low):
            n = int(low[0])
        for j in range(n):
            if self.backend.is_eog(int(toks[j])):
                return toks[: j + 1]
        return toks[:n]
