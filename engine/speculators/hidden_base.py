"""What the hidden-state speculators (mtp, eagle3) share: a head that reads the target's hidden rows.

Both run a small decoder ("head") whose input at KV position q is a pair
(token, row): MTP pairs token x_q with the target's final hidden state after
x_{q-1}; EAGLE-3 pairs x_{q+1} with its encoding of three target layers'
inputs at q (so its positions run one behind: `pos_offset` -1). The head's KV
cache mirrors the target's committed sequence, one sequence per slot; its
rows come from the target (engine/hidden_rows.py) and never from a guess.

Life of a sequence (all slots at once, as llama.cpp's common_speculative):

- `take_hidden(record)` files the round's rows; `process(seq, tokens, pos)`
  pops the rows of exactly those committed tokens (a row of another sequence
  or position is a RowMismatch: the sequence stops drafting, counted) and
  queues the head's input pairs. Decoding them is deferred to the next draft
  call, so they share its first batched decode.
- `draft(requests)`: step 1 decodes, per sequence, its queued pairs plus the
  seed (the last sampled token with the last committed row) and outputs the
  head's prediction; step i>1 feeds the drafted token with the head's own
  output row. ONE batched decode per step for all slots. After drafting the
  KV keeps only the committed pairs and the seed (which the next commit
  produces again, so it is not decoded twice); the drafted pairs leave it.
- a rejected draft costs nothing more: the head's KV never held it.

The head model is behind `HiddenBackend` (native/mtp_backend.py,
native/eagle3_backend.py); this module has no llama.cpp import.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import Field

from specray.engine.cost import DecodeCostModel
from specray.engine.hidden_rows import ROW_DTYPE, HiddenRows, RowMismatch, RowStash, Tap, mtp_input_rows
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE, DraftRequest

from .draft import TokenBuffer, common_prefix
from .draft_base import ModelDraftParams, ModelSpeculator, SlotMirror

log = logging.getLogger("specray.hidden")

#: a first draft step of this many rows or more is a catch-up (a steady one has a pair or two per sequence)
CATCHUP_ROWS = 8


class HiddenDraftParams(ModelDraftParams):
    """Parameters of a hidden-state speculator (mtp, eagle3)."""

    audit: bool = Field(
        False, description="keep every row received, by sequence and position (tests and diagnostics; memory grows "
        "with the context)")


class HiddenBackend(Protocol):
    """A head context with one sequence per slot, fed (token, row) pairs."""

    n_batch: int
    width: int  # row width the head's decoder takes
    taps: tuple[Tap, ...]  # what it needs from the target, in this column order

    def decode(self, runs: list[tuple[int, np.ndarray, int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode runs of (seq_id, tokens, pos0, rows [n, width]). Returns, for the last pair of each run, the
        head's top token, its probability and the head's output row (fed back at the next draft step)."""
        ...

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """Rows as the target sent them -> the decoder's input rows (identity for MTP)."""
        ...

    def seq_rm(self, seq_id: int, p0: int) -> None: ...

    def is_eog(self, token: int) -> bool: ...

    def decode_costs(self) -> dict[int, float]: ...


@dataclass
class _HSeq:
    committed: TokenBuffer = field(default_factory=TokenBuffer)  # tokens the target committed (process)
    kv: TokenBuffer = field(default_factory=TokenBuffer)  # head input tokens in the KV cache, index = position
    prev_row: np.ndarray | None = None  # the target's row after the last committed token
    queue: list[tuple[np.ndarray, int, np.ndarray]] = field(default_factory=list)  # pairs not decoded yet
    lost: bool = False  # rows went missing: the head cannot mirror this sequence any more

    def queued_end(self) -> int:
        if not self.queue:
            return self.kv.n
        toks, p0, _ = self.queue[-1]
        return p0 + len(toks)


@dataclass
class HiddenCounters:
    steps: int = 0  # batched head decodes
    decode_seconds: float = 0.0
    encode_seconds: float = 0.0
    catchup_pairs: int = 0  # committed pairs decoded into the head's KV
    drafted_tokens: int = 0
    rows_taken: int = 0  # per-sequence entries taken from records
    records: int = 0
    row_bytes: int = 0  # bytes of the columns this speculator took
    unsynced: int = 0  # draft requests for a sequence whose committed tokens the head has not seen
    mismatched: int = 0  # commits whose rows were missing or belonged to other tokens/positions (RowMismatch)
    lost: int = 0  # sequences that stopped drafting because of that
    failures: int = 0  # head decodes that failed


class RowMirror(SlotMirror):
    """A model speculator whose per-sequence state follows the target's hidden rows (mtp, eagle3, dflash).

    A subclass keeps `seqs` (seq_id -> state with `committed` and `lost`), `stash` (a RowStash the round's rows
    are filed in), `counters` (with `mismatched`), `params` (with `audit`) and `audit`, and says how a sequence
    starts over (`_reset`) and stops drafting (`_lose`); this class pairs a commit with its rows.
    """

    def _reset(self, seq_id: int):
        """A fresh state for seq_id (its cells and rows cleared); returns it."""
        raise NotImplementedError

    def _lose(self, seq_id: int, st, why: str) -> None:
        """seq_id stops drafting (its rows went missing or no longer follow its tokens)."""
        raise NotImplementedError

    def _commit_rows(self, seq_id: int, tokens, pos: int):
        """(state, tokens, rows) of a commit whose rows the stash holds; None where the sequence no longer
        drafts, or its rows do not match (it then stops drafting: never a draft from a wrong row)."""
        st = self.seqs.get(seq_id) or self._reset(seq_id)
        if st.lost:
            self.stash.drop(seq_id)
            return None
        tokens = np.asarray(tokens, dtype=TOKEN_DTYPE)
        try:
            rows = self.stash.pop(seq_id, tokens, pos)
        except RowMismatch as e:
            self.counters.mismatched += 1
            self._lose(seq_id, st, str(e))
            return None
        return st, tokens, rows

    def _audit_rows(self, seq_id: int, tokens: np.ndarray, pos: int, rows: np.ndarray) -> None:
        """With params.audit: keep (token, row) by position, for the tests that check rows against a solo run."""
        if self.params.audit:
            log_ = self.audit.setdefault(seq_id, {})
            for j, t in enumerate(tokens):
                log_[pos + j] = (int(t), np.array(rows[j], dtype=ROW_DTYPE))


class HiddenStateSpeculator(RowMirror, ModelSpeculator):
    """Base of mtp and eagle3; subclasses set `name` and `pos_offset`."""

    #: KV position of the pair whose token is x_q, minus q (MTP 0, EAGLE-3 -1)
    pos_offset: int = 0

    def __init__(self, params: HiddenDraftParams | None, backend: HiddenBackend) -> None:
        super().__init__()
        self.params = params or HiddenDraftParams()
        self.backend = backend
        self.max_steps = self.params.n_max
        self.taps = tuple(backend.taps)
        self.seqs: dict[int, _HSeq] = {}
        self.stash = RowStash()
        self.counters = HiddenCounters()
        self.step_cost = DecodeCostModel(backend.decode_costs() or None, ema=0.1)
        self.catchup_per_seq = 2.0
        self.overhead_seconds = 0.0
        # the encoder's time per row of a catch-up (EAGLE-3's fc over each target row: a large share of a
        # prompt's catch-up), learnt from encodes of CATCHUP_ROWS+ rows; a steady draft's encode is in overhead_seconds
        self.encode_row_seconds = 0.0
        self.audit: dict[int, dict[int, tuple[int, np.ndarray]]] = {}  # seq -> pos -> (token, row)

    # ---- cost ------------------------------------------------------------------------------------
    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        n = max(1, n_seqs)
        first = self.step_cost.cost(max(n, round(n * self.catchup_per_seq)))
        return self.overhead_seconds + first + max(0, n_steps - 1) * self.step_cost.cost(n)

    def catchup_seconds(self, seq_id: int, history) -> float:
        st = self.seqs.get(seq_id)
        rows = 1 + sum(len(t) for t, _, _ in st.queue) if st is not None else len(history)
        steady = max(1, round(self.catchup_per_seq))
        if rows <= steady:
            return 0.0
        decode = max(0.0, self.step_cost.cost(rows) - self.step_cost.cost(steady))
        return decode + (rows - steady) * self.encode_row_seconds

    # ---- sequence life ---------------------------------------------------------------------------
    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self._reset(seq_id)

    def _end(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.backend.seq_rm(seq_id, 0)
        self.stash.drop(seq_id)
        self.audit.pop(seq_id, None)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: the head's pairs need the target's hidden rows of the tokens before them, and the rows
        of the shifted cells are not made again: the sequence stops drafting with this head (still lossless)."""
        st = self.seqs.get(seq_id)
        if st is not None:
            self._lose(seq_id, st, "its context shifted")

    def _reset(self, seq_id: int) -> _HSeq:
        st = self.seqs[seq_id] = _HSeq()
        self.backend.seq_rm(seq_id, 0)  # the slot may hold another sequence's cells
        self.stash.drop(seq_id)
        self.audit.pop(seq_id, None)
        return st

    def take_hidden(self, record: HiddenRows) -> None:
        """This round's rows from the target (all its sequences); process() then consumes them."""
        cols = record.columns(self.taps)
        before = self.stash.taken
        self.stash.take(record, cols)
        self.counters.records += 1
        self.counters.rows_taken += self.stash.taken - before
        self.counters.row_bytes += record.n_rows * (cols.stop - cols.start) * record.rows.itemsize

    def _lose(self, seq_id: int, st: _HSeq, why: str) -> None:
        if not st.lost:
            log.warning("hidden-state speculator %s stops drafting for sequence %s: %s", self.name, seq_id, why)
            self.counters.lost += 1
        st.lost = True
        st.queue.clear()
        self.stash.drop(seq_id)

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos...; their rows must be in the stash."""
        got = self._commit_rows(seq_id, tokens, pos)
        if got is None:
            return
        st, tokens, rows = got
        if pos != st.committed.n:
            self.counters.mismatched += 1
            self._lose(seq_id, st, f"tokens committed at {pos}, the head mirrors {st.committed.n}")
            return
        self._audit_rows(seq_id, tokens, pos, rows)
        st.committed.extend(tokens)
        prev = st.prev_row if st.prev_row is not None else np.zeros(rows.shape[1], dtype=ROW_DTYPE)
        inp = mtp_input_rows(rows, prev)
        st.prev_row = np.array(rows[-1], dtype=ROW_DTYPE)
        toks, p0 = tokens, pos + self.pos_offset
        if p0 < 0:  # EAGLE-3: the first token has no pair (nothing before it)
            toks, inp, p0 = toks[-p0:], inp[-p0:], 0
        # pairs the KV already holds (the last draft's seed) are not decoded again
        keep = common_prefix(st.kv.view()[p0:], toks) if st.kv.n > p0 else 0
        if st.kv.n > p0 + keep:
            self.backend.seq_rm(seq_id, p0 + keep)
            st.kv.truncate(p0 + keep)
        if keep < len(toks):
            if st.queued_end() != p0 + keep:
                self._lose(seq_id, st, f"pairs queued up to {st.queued_end()}, next pair at {p0 + keep}")
                return
            st.queue.append((toks[keep:].copy(), p0 + keep, inp[keep:]))

    # ---- drafting -----------------------------------------------------------------------------------
    def _draft_one(self, req: DraftRequest) -> np.ndarray:  # pragma: no cover - draft() is batched
        return self.draft([req])[0]

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        p = self.params
        out = [EMPTY_DRAFT] * len(requests)
        first: list[tuple[int, np.ndarray, int, np.ndarray]] = []  # runs of step 1 (rows as the target sent)
        drafting: list[tuple[int, DraftRequest, _HSeq, int, list[int]]] = []  # (i, req, st, kv_n before, result)
        for i, req in enumerate(requests):
            self.stats.calls += 1
            h = req.history
            if req.n_max <= 0 or len(h) == 0:
                continue
            st = self.seqs.get(req.seq_id)
            n = len(h) - 1
            if (st is None or st.lost or st.prev_row is None or st.committed.n != n
                    or int(st.committed.buf[n - 1]) != int(h[n - 1])):
                self.counters.unsynced += 1
                continue
            seed_pos = n + self.pos_offset
            if st.queued_end() != seed_pos:
                self._lose(req.seq_id, st, f"pairs reach {st.queued_end()}, the seed goes at {seed_pos}")
                continue
            toks = [t for t, _, _ in st.queue] + [np.array([h[-1]], dtype=TOKEN_DTYPE)]
            rows = [r for _, _, r in st.queue] + [st.prev_row[None, :]]
            pos0 = st.queue[0][1] if st.queue else seed_pos
            first.append((req.seq_id, np.concatenate(toks), pos0, np.concatenate(rows)))
            drafting.append((i, req, st, st.kv.n, []))
        if not drafting:
            self.stats.time_draft_s += time.perf_counter() - t0
            return out
        rows = sum(len(r[1]) for r in first)
        self.catchup_per_seq += 0.1 * (min(rows, 8 * len(first)) / len(first) - self.catchup_per_seq)
        decode_s = 0.0
        try:
            te = time.perf_counter()
            enc = self.backend.encode(np.concatenate([r[3] for r in first]))
            te = time.perf_counter() - te
            self.counters.encode_seconds += te
            if rows >= CATCHUP_ROWS:
                self.encode_row_seconds += 0.2 * (te / rows - self.encode_row_seconds)
            runs, o = [], 0
            for seq_id, toks, pos0, r in first:
                runs.append((seq_id, toks, pos0, enc[o : o + len(toks)]))
                o += len(toks)
            for (_, _, st, _, _), (_, toks, pos0, _) in zip(drafting, first):
                st.kv.truncate(pos0)
                st.kv.extend(toks)
                self.counters.catchup_pairs += len(toks) - 1
            active = list(drafting)
            while runs:
                td = time.perf_counter()
                top, prob, hid = self.backend.decode(runs)
                dt = time.perf_counter() - td
                self.step_cost.observe(sum(len(r[1]) for r in runs), dt)
                self.counters.steps += 1
                self.counters.decode_seconds += dt
                decode_s += dt
                next_runs, still = [], []
                for (i, req, st, kv0, res), (seq_id, toks, pos0, _), tok, pr, row in zip(active, runs, top, prob, hid):
                    tok = int(tok)
                    if pr < p.p_min:
                        continue
                    res.append(tok)
                    if self.backend.is_eog(tok) or len(res) >= min(p.n_max, req.n_max):
                        continue
                    next_runs.append((seq_id, np.array([tok], dtype=TOKEN_DTYPE), pos0 + len(toks),
                                      np.asarray(row, dtype=ROW_DTYPE)[None, :]))
                    still.append((i, req, st, kv0, res))
                runs, active = next_runs, still
        except Exception:
            # the head's KV may hold part of this call: back to what it held before; the queue stays
            self.counters.failures += 1
            log.exception("%s head decode failed; no drafts this call", self.name)
            for _, req, st, kv0, _ in drafting:
                try:
                    self.backend.seq_rm(req.seq_id, kv0)
                except Exception:
                    log.exception("clearing the head cache of sequence %s failed", req.seq_id)
                st.kv.truncate(kv0)
            self.stats.time_draft_s += time.perf_counter() - t0
            return out
        for i, req, st, _, res in drafting:
            # keep the committed pairs and the seed; the drafted pairs leave the KV
            self.backend.seq_rm(req.seq_id, st.kv.n)
            st.queue.clear()
            self.counters.drafted_tokens += len(res)
            if len(res) < max(1, p.n_min):
                continue
            out[i] = np.asarray(res[: req.n_max], dtype=TOKEN_DTYPE)
            self.stats.drafts_generated += 1
        wall = time.perf_counter() - t0
        self.overhead_seconds += 0.1 * (max(0.0, wall - decode_s) - self.overhead_seconds)
        self.stats.time_draft_s += wall
        return out
