"""draft: a separate small model drafts for every slot, one batched decode per draft step.

As llama.cpp's `draft` speculator with parallel slots (PR 22838): one draft
context holds one sequence per slot. Each draft() call, for all asked
sequences at once:

1. catch up: every sequence's draft KV cache is brought level with its
   history (prompt + accepted tokens + the last sampled token): the cached
   prefix that still agrees is kept, the rest is decoded. The catch-up rows
   of all sequences go into the same batch as their first draft step;
2. draft step i: ONE batched decode with one row per still-drafting
   sequence; a sequence stops when the draft model's probability of its top
   token is below `p_min`, after an end-of-generation token, or at `n_max`
   tokens; drafts shorter than `n_min` are dropped.

The draft context sees everything the target saw: `process()` mirrors each
target batch (prompt chunks, then [last token + accepted draft tokens]) and
removes the rejected tail of the previous draft from the draft KV cache at
once, so the draft cache never holds a token the target rejected. Decoding
the mirrored tokens is deferred to the next draft step (they share its
batch), so a round costs n_max draft decodes, not n_max + 1.

Cross-vocabulary mode (`translator` given): the draft context holds the
draft-vocab tokenisation of the sequence's text (draft_text.TextMirror),
drafts are turned into text and tokenised for the target, and only tokens
whose text aligns are kept.

The draft model itself is behind `DraftBackend` (native/draft_backend.py),
so this module stays free of llama.cpp.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specray.engine.cost import DecodeCostModel
from specray.engine.draft_tree import Branch, runner_ups_within
from specray.engine.speculator import EMPTY_DRAFT, TOKEN_DTYPE, DraftRequest
from specray.engine.prompt_cache import common_prefix

from ._util import HistoryCursor
from .draft_base import DraftParams, ModelSpeculator, SlotMirror
from .draft_text import TextMirror, TextVocab, to_target_tokens

log = logging.getLogger("specray.draft")


class DraftBackend(Protocol):
    """A draft-model context with one sequence per slot."""

    n_batch: int
    vocab: TextVocab  # the draft model's tokenizer (cross-vocab mode)
    prefix: tuple[int, ...]  # tokens the draft model expects before any text (its BOS), cross-vocab mode

    def decode(self, runs: list[tuple[int, np.ndarray, int]], runner_ups: bool = False) -> tuple[np.ndarray, ...]:
        """Decode runs of (seq_id, tokens, pos0) (split into batches of n_batch rows if needed).
        Returns the draft model's top token and its probability after the last token of each run; asked for
        `runner_ups`, where the backend has them, also its second token and that one's probability: (top, prob,
        second, second_prob). The runner-ups become a draft tree's branches."""
        ...

    def seq_rm(self, seq_id: int, p0: int) -> int | None:
        """Remove seq_id's cache cells at positions >= p0. Returns the cells kept (None: p0): fewer where a
        recurrent state could only come back to an earlier checkpoint (the rest is decoded again)."""
        ...

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        """Context shift of seq_id's cells (drop [n_keep, n_keep + n_discard), move the later ones back); False
        where the model cannot (optional: a backend without it is reset instead)."""
        ...

    def checkpoint(self, seq_id: int, pos: int) -> None:
        """Save seq_id's state at `pos` cells for seq_rm to come back to (recurrent models; else nothing)."""
        ...

    def is_eog(self, token: int) -> bool: ...

    def decode_costs(self) -> dict[int, float]:
        """Seconds per decode of n rows, measured at start-up."""
        ...


class Translator(Protocol):
    """Cross-vocab mode: the target's tokenizer, and which target tokens carry no text for the draft."""

    target: TextVocab
    skip: frozenset[int]  # target tokens left out of the text (its BOS)


class TokenBuffer:
    """A growable int32 array (a sequence's tokens)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.zeros(64, dtype=TOKEN_DTYPE)
        self.n = 0

    def view(self) -> np.ndarray:
        return self.buf[: self.n]

    def extend(self, toks) -> None:
        toks = np.asarray(toks, dtype=TOKEN_DTYPE)
        need = self.n + len(toks)
        if need > len(self.buf):
            grown = np.zeros(max(2 * len(self.buf), need), dtype=TOKEN_DTYPE)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = toks
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, max(0, n))

    def delete(self, p0: int, p1: int) -> None:
        """Drop tokens [p0, p1), the later ones move down (a context shift)."""
        p1 = min(p1, self.n)
        if p0 < p1:
            self.buf[p0 : self.n - (p1 - p0)] = self.buf[p1 : self.n].copy()
            self.n -= p1 - p0


@dataclass
class _SeqState:
    kv: TokenBuffer = field(default_factory=TokenBuffer)  # draft-vocab tokens in the draft KV cache, index = position
    committed: TokenBuffer = field(default_factory=TokenBuffer)  # target tokens the target committed (via process)
    text: TextMirror | None = None  # cross-vocab: the sequence's text and its draft-vocab tokens
    text_cursor: HistoryCursor = field(default_factory=HistoryCursor)  # history the text mirror was built from
    drafted_at: int = -1  # history length at the last draft call (-1: never drafted)
    # the last draft's tokens and its runner-ups: one-token branches weighted by their probability over the
    # drafted token's
    last_draft: np.ndarray | None = None
    runner_ups: list[Branch] = field(default_factory=list)


@dataclass
class DraftCounters:
    steps: int = 0  # batched draft decodes (a round with n_max 3 costs up to 3)
    decode_seconds: float = 0.0
    catchup_tokens: int = 0  # tokens decoded to bring caches level with the histories
    drafted_tokens: int = 0  # draft-model tokens produced (before n_min and translation)
    rolled_back: int = 0  # draft KV cells removed (rejected tails, retokenised text)
    unsynced: int = 0  # draft() calls whose history did not extend what process() mirrored
    translated_empty: int = 0  # cross-vocab drafts with no aligned target token
    retokenised: int = 0  # cross-vocab: draft-vocab tokens produced by tail retokenisation
    failures: int = 0  # draft decodes that failed (e.g. draft context full): no drafts that call


class DraftSpeculator(SlotMirror, ModelSpeculator):
    """The draft model's drafts. Where the backend gives each step's runner-up (same vocabulary only), a draft
    also holds a one-token branch at every depth, the draft model's second choice there, weighted by its
    probability over the drafted token's: a draft tree's branches (`branches`), as EAGLE-2 and SpecInfer take
    a draft model's top-k. The runner-ups are found only once `branches` has been asked for them
    (`runner_ups_wanted`: the chain sends trees), so a linear chain pays nothing for them."""

    name = "draft"

    def __init__(self, params: DraftParams | None, backend: DraftBackend, translator: Translator | None = None) -> None:
        super().__init__()
        self.params = params or DraftParams()
        self.backend = backend
        self.translator = translator
        self.offers_branches = translator is None  # a runner-up in the draft's vocabulary is no target token
        self.runner_ups_wanted = False  # set by the first `branches` call
        self.max_steps = self.params.n_max
        self.seqs: dict[int, _SeqState] = {}
        self.counters = DraftCounters()
        self.step_cost = DecodeCostModel(backend.decode_costs() or None, ema=0.1)
        # what a draft call costs besides its draft steps, learnt as it runs: catch-up rows per sequence
        # in the first step (mirrored tokens not decoded yet, retokenised text), and Python time per call
        self.catchup_per_seq = 2.0
        self.overhead_seconds = 0.0

    @property
    def cross_vocab(self) -> bool:
        return self.translator is not None

    # ---- cost ------------------------------------------------------------------------------
    def draft_seconds(self, n_seqs: int, n_steps: int) -> float:
        n = max(1, n_seqs)
        first = self.step_cost.cost(max(n, round(n * self.catchup_per_seq)))
        return self.overhead_seconds + first + max(0, n_steps - 1) * self.step_cost.cost(n)

    def pending_rows(self, seq_id: int, history: np.ndarray) -> int:
        """Rows a draft call would decode for seq_id before its first draft token (an estimate)."""
        st = self.seqs.get(seq_id)
        if st is None or st.kv.n == 0:
            return len(history)
        if self.translator is None:
            return max(1, len(history) - st.kv.n)
        # through text: untranslated target tokens (~1 draft token each) + the retokenised tail's changes
        return max(1, len(history) - st.text.n_target) + 2

    def catchup_seconds(self, seq_id: int, history: np.ndarray) -> float:
        steady = max(1, round(self.catchup_per_seq))
        rows = self.pending_rows(seq_id, history)
        return max(0.0, self.step_cost.cost(rows) - self.step_cost.cost(steady)) if rows > steady else 0.0

    # ---- sequence life --------------------------------------------------------------------------
    def _state(self, seq_id: int) -> _SeqState:
        st = self.seqs.get(seq_id)
        if st is None:
            st = self.seqs[seq_id] = _SeqState()
            if self.translator is not None:
                st.text = TextMirror(self.backend.vocab, self.backend.prefix, self.params.window)
            self.backend.seq_rm(seq_id, 0)  # the slot may hold another sequence's cells
        return st

    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        self.seqs.pop(seq_id, None)
        self._state(seq_id)

    def _end(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.backend.seq_rm(seq_id, 0)

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos...: mirror them, drop the rejected draft tail."""
        st = self._state(seq_id)
        tokens = np.asarray(tokens, dtype=TOKEN_DTYPE)
        if pos > st.committed.n:  # a gap: some target batch was not mirrored; draft() resyncs from history
            st.committed.truncate(0)
        else:
            st.committed.truncate(pos)
            st.committed.extend(tokens)
        if self.translator is None:
            # cells past the agreeing prefix of this batch hold draft tokens the target did not keep
            kv = st.kv.view()
            end = pos + len(tokens)
            keep = min(st.kv.n, pos + common_prefix(kv[pos:end], tokens)) if st.kv.n > pos else st.kv.n
            self._truncate_kv(seq_id, st, keep)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: the draft cache shifts as the target's did, is cut back to the kept cells (it did not
        reach past the discarded ones) or, where it cannot shift (recurrent, cross-vocab), starts afresh."""
        st = self.seqs.get(seq_id)
        if st is None:
            return
        end = n_keep + n_discard
        # (a committed list short of the discarded cells: process() was not wired; draft() resyncs from history)
        st.committed.delete(n_keep, end) if st.committed.n >= end else st.committed.truncate(n_keep)
        st.drafted_at = -1
        shift = getattr(self.backend, "shift", None)
        if self.translator is not None or (st.kv.n > end and not (shift and shift(seq_id, n_keep, n_discard))):
            self._forget(seq_id)
        elif st.kv.n > end:
            st.kv.delete(n_keep, end)
        else:
            self._truncate_kv(seq_id, st, min(st.kv.n, n_keep))

    def _truncate_kv(self, seq_id: int, st: _SeqState, keep: int) -> None:
        if keep < st.kv.n:
            kept = self.backend.seq_rm(seq_id, keep)
            kept = keep if kept is None else min(kept, keep)  # a recurrent model may come back further
            self.counters.rolled_back += st.kv.n - kept
            st.kv.truncate(kept)

    # ---- what the draft cache must hold ------------------------------------------------------------
    def _wanted(self, st: _SeqState, history: np.ndarray) -> np.ndarray:
        """Draft-vocab tokens for `history` (target tokens)."""
        if self.translator is None:
            return history
        mirror = st.text
        if not st.text_cursor.is_extension(history) or len(history) < mirror.n_target:
            mirror.reset()
            st.text_cursor.reset()
        new = history[mirror.n_target :]
        if len(new):
            skip = self.translator.skip
            piece = self.translator.target.piece
            before = mirror.retokenised
            mirror.extend([piece(int(t)) for t in new if int(t) not in skip], n_target=len(new))
            self.counters.retokenised += mirror.retokenised - before
            st.text_cursor.advance(history)
        return np.asarray(mirror.tokens, dtype=TOKEN_DTYPE)

    def _level(self, seq_id: int, st: _SeqState, want: np.ndarray, runs: list, need_logits: bool) -> None:
        """Keep the cached prefix that agrees with `want`, queue the rest for decoding."""
        keep = common_prefix(st.kv.view(), want)
        if need_logits:
            keep = min(keep, len(want) - 1)  # the last token must be decoded again to get its logits
        self._truncate_kv(seq_id, st, keep)
        feed = want[keep:]
        if len(feed):
            runs.append((seq_id, feed, keep))
            st.kv.extend(feed)
            self.counters.catchup_tokens += len(feed)

    def sync(self, seq_ids: list[int] | None = None) -> None:
        """Decode what process() mirrored but no draft step has decoded yet (the draft cache then holds
        exactly the committed tokens; used by tests and diagnostics)."""
        runs: list = []
        for seq_id in self.seqs if seq_ids is None else seq_ids:
            st = self.seqs.get(seq_id)
            if st is None:
                continue
            self._level(seq_id, st, self._wanted(st, st.committed.view()), runs, need_logits=False)
        if runs:
            self.backend.decode(runs)

    # ---- drafting -----------------------------------------------------------------------------------
    def _draft_one(self, req: DraftRequest) -> np.ndarray:  # pragma: no cover - draft() is batched
        return self.draft([req])[0]

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        p = self.params
        out = [EMPTY_DRAFT] * len(requests)
        runs: list[tuple[int, np.ndarray, int]] = []
        drafting: list[tuple[int, DraftRequest, _SeqState, int, list[int]]] = []
        steady: set[int] = set()  # sequences drafted in a recent round (their catch-up is the steady state's)
        for i, req in enumerate(requests):
            self.stats.calls += 1
            h = np.asarray(req.history, dtype=TOKEN_DTYPE)
            if req.n_max <= 0 or len(h) == 0:
                continue
            st = self._state(req.seq_id)
            if st.committed.n != len(h) - 1 or not np.array_equal(st.committed.view(), h[:-1]):
                self.counters.unsynced += 1  # process() was not wired for this sequence: take the history
                st.committed.truncate(0)
                st.committed.extend(h[:-1])
            if 0 <= st.drafted_at and len(h) - st.drafted_at <= self.max_steps + 2:
                steady.add(req.seq_id)
            st.drafted_at = len(h)
            want = self._wanted(st, h)
            if len(want) == 0:
                continue
            self._level(req.seq_id, st, want, runs, need_logits=True)
            # cross-vocab: one draft token more than the target tokens asked for (a draft token is
            # roughly one target token, and the last translated token may be dropped as unfinished)
            cap = min(p.n_max, req.n_max + (1 if self.translator is not None else 0))
            st.last_draft, st.runner_ups = None, []
            drafting.append((i, req, st, cap, []))
        active = list(drafting)
        steady_runs = [r for r in runs if r[0] in steady]
        if steady_runs:  # the steady state: a sequence caught up after a pause (an exploring draft) does not count
            rows = sum(len(r[1]) for r in steady_runs)
            self.catchup_per_seq += 0.1 * (rows / len(steady_runs) - self.catchup_per_seq)
        decode_s = 0.0
        save = getattr(self.backend, "checkpoint", None)
        first = True
        try:
            while runs:
                td = time.perf_counter()
                want = self.runner_ups_wanted and self.offers_branches
                top, prob, *alt = self.backend.decode(runs, runner_ups=True) if want else self.backend.decode(runs)
                dt = time.perf_counter() - td
                if first and save is not None:
                    # the committed tokens are in: a recurrent model's state is saved here, before draft tokens
                    for _, req, st, _, _ in active:
                        save(req.seq_id, st.kv.n)
                    first = False
                n_rows = sum(len(r[1]) for r in runs)
                self.step_cost.observe(n_rows, dt)
                self.counters.steps += 1
                self.counters.decode_seconds += dt
                decode_s += dt
                runs, still = [], []
                for j, ((i, req, st, cap, res), tok, pr) in enumerate(zip(active, top, prob)):
                    tok = int(tok)
                    if pr < p.p_min:
                        continue
                    eog = self.backend.is_eog(tok)
                    if eog and self.translator is not None:
                        continue  # the draft model's end of text: nothing to translate
                    if alt and alt[1][j] > 0.0:
                        st.runner_ups.append(Branch(len(res), np.array([alt[0][j]], dtype=TOKEN_DTYPE),
                                                    min(1.0, float(alt[1][j]) / float(pr))))
                    res.append(tok)
                    if eog or len(res) >= cap:
                        continue
                    runs.append((req.seq_id, np.array([tok], dtype=TOKEN_DTYPE), st.kv.n))
                    st.kv.extend([tok])
                    still.append((i, req, st, cap, res))
                active = still
        except Exception:
            # the draft caches of these sequences are in an unknown state: forget them (rebuilt next time)
            self.counters.failures += 1
            log.exception("draft decode failed; no model drafts this call")
            for _, req, st, _, _ in drafting:
                self._forget(req.seq_id)
            self.stats.time_draft_s += time.perf_counter() - t0
            return out
        for i, req, st, cap, res in drafting:
            self.counters.drafted_tokens += len(res)
            if len(res) < max(1, p.n_min):
                continue
            d = np.asarray(res, dtype=TOKEN_DTYPE)
            if self.translator is not None:
                d = self._translate(req, d)
            d = d[: req.n_max]
            if len(d):
                self.stats.drafts_generated += 1
                out[i] = d
                st.last_draft = d
        wall = time.perf_counter() - t0
        if drafting:
            self.overhead_seconds += 0.1 * (max(0.0, wall - decode_s) - self.overhead_seconds)
        self.stats.time_draft_s += wall
        return out

    def _branches(self, seq_id: int, main: list[int], width: int) -> list[Branch]:
        """The last draft's runner-ups within `main` (a prefix of that draft), most likely first: each a
        one-token branch at its depth. The first call turns the runner-ups on for the drafts after it."""
        self.runner_ups_wanted = True
        st = self.seqs.get(seq_id)
        return [] if st is None else runner_ups_within(st.last_draft, st.runner_ups, main, width)

    def _translate(self, req: DraftRequest, draft_tokens: np.ndarray) -> np.ndarray:
        piece = self.backend.vocab.piece
        text = b"".join(piece(int(t)) for t in draft_tokens)
        d = to_target_tokens(self.translator.target, req.history[-1:], text, self.params.keep_last)
        if len(d) == 0:
            self.counters.translated_empty += 1
        return d

    def _forget(self, seq_id: int) -> None:
        st = self.seqs.get(seq_id)
        if st is None:
            return
        st.kv.truncate(0)
        if st.text is not None:
            st.text.reset()
            st.text_cursor.reset()
        try:
            self.backend.seq_rm(seq_id, 0)
        except Exception:
            log.exception("clearing the draft cache of sequence %s failed", seq_id)
