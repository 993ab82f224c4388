"""The target side of a round: one batched decode, verification, KV rollback.

`TargetRunner` owns a target context (duck-typed: specray.native.Context) and
the sampling state of every sequence in it. One `step` takes every active
sequence's rows (prompt chunks, or [last token + draft]), decodes them in as
few llama_decode calls as n_batch allows, verifies each sequence's draft where
the logits are (they never leave this object), removes rejected draft rows
from the KV cache and returns only token ids. In the distributed deployment
this object lives in the target actor; co-located, in the router's process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .constraint import ConstraintError, ConstraintFactory, TokenConstraint
from .draft_tree import DraftTree
from .hidden_rows import pack_rows
from .logprobs import TokenLogprobs, prompt_rows, token_logprobs
from .rollback import RollbackStats, StateRollback
from .sampling import SamplingParams
from .target_calibration import DECODE_SIZES, calibrate_cost, measure_attention_cost, measure_decode_costs
from .verify import verify_greedy, verify_sampled_coupled
from .verify_tree import TreeVerdict, verify_tree_greedy, verify_tree_sampled
from .verify_shape import padded_rows


class TargetContext(Protocol):  # what specray.native.Context provides
    n_batch: int
    batch: Any

    def decode(self, batch: Any = None) -> np.ndarray: ...
    # the two halves of decode, for an overlapped round (TargetRunner.launch / collect)
    def launch(self, batch: Any = None) -> None: ...
    def logits(self, n_outputs: int) -> np.ndarray: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def clear_seq(self, seq_id: int) -> None: ...
    def shift_seq(self, seq_id: int, n_keep: int, n_discard: int) -> bool: ...
    def save_seq(self, seq_id: int) -> Any: ...
    def load_seq(self, seq_id: int, buf: Any) -> bool: ...
    def recycle(self, buf: Any) -> None: ...
    def recycled_bytes(self) -> int: ...


@dataclass
class StepItem:
    """One sequence's rows in a round."""

    seq_id: int
    tokens: np.ndarray  # int32: n_commit context tokens, then n_draft draft tokens
    pos0: int  # KV position of tokens[0]
    n_draft: int = 0
    sample: bool = True  # False for a prompt chunk that is not the prompt's last
    hidden: bool = False  # a hidden-state speculator (mtp, eagle3) needs the committed rows' hidden states
    # leading rows that replay what a restored recurrent state took back (rollback.py): already emitted and
    # mirrored, so neither the penalty window nor the hidden rows see them again
    n_replay: int = 0
    # context shift (engine/context_shift.py) applied before these rows are decoded: (cells kept, cells discarded
    # after them); pos0 is already the shifted position
    shift: tuple[int, int] | None = None
    # the draft as a tree (engine/draft_tree.py): its n_draft tokens are the tree's nodes; None: a linear draft
    tree: DraftTree | None = None
    # rows after this item's own (and its verify pads) that only give the decode the attention kernel's tile
    # (engine/tile_pads.py): its last token repeated, no output, their cells dropped right after the decode
    tile_pad: int = 0

    @property
    def n_commit(self) -> int:
        return len(self.tokens) - self.n_draft


@dataclass
class StepResult:
    seq_id: int
    tokens: np.ndarray  # accepted draft tokens followed by the sampled token; empty if not sampled
    n_accepted: int = 0
    margins: np.ndarray | None = None  # top-2 logit margin of each emitted token (record_margins)
    # the sequence cannot go on (its state could not be rolled back, rollback.py): it ends with this error
    error: str | None = None
    n_replay: int = 0  # rows its next verify replays in front of its own (checkpoint rollback)
    logprobs: TokenLogprobs | None = None  # of `tokens`, where the request asked for them (SamplingParams.logprobs)
    # of the prompt tokens this chunk's rows predict (echo: SamplingParams.prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None
    branch: int = 0  # a tree's accepted branch (0: its main draft; draft_tree.DraftTree.leaves)


@dataclass
class StepOutput:
    results: list[StepResult]
    decode_seconds: float
    n_tokens: int
    n_decodes: int
    batch_sizes: list[int] = field(default_factory=list)  # tokens per llama_decode
    seqs_per_decode: list[int] = field(default_factory=list)
    # host time of verification: reading the logits rows, accepting or sampling, rolling back rejected rows
    verify_seconds: float = 0.0
    # the bench's instrumentation in the verification (record_margins' top-2 margins), left out of verify_seconds
    instrument_seconds: float = 0.0
    # hidden rows of the committed tokens of items with hidden=True (engine/hidden_rows.py HiddenRows); in the
    # target actor, replaced by its transport's handle (deployments/actors/row_transport.py)
    hidden: Any = None
    # this round's rollback work (rollback.RollbackStats; None where the target trims a KV cache)
    rollback: RollbackStats | None = None
    # the host tier since the last round: saves (TargetRunner.stash: key -> bytes held, 0: nothing saved) and
    # restores (TargetRunner.start with `restore`: key, seconds, whether llama.cpp took the cells)
    stashed: dict[int, int] = field(default_factory=dict)
    restored: list[tuple[int, float, bool]] = field(default_factory=list)
    # bytes of dropped saves' buffers the target keeps for its next saves (Context.recycle): the host tier counts
    # them against its budget
    host_kept: int = 0


@dataclass
class _Session:
    params: SamplingParams
    seed: int  # the request's seed, or a random one
    window: np.ndarray  # last tokens of the sequence (for the repetition penalty)
    prompt: np.ndarray | None = None  # kept where the request reports its prompt's logprobs (echo)
    constraint: TokenConstraint | None = None  # the request's grammar state (SamplingParams.grammar)
    # whether the penalties read `window` (push keeps it): asked for every verified item, so decided once
    windowed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.windowed = self.params.repeat_last_n > 0 and self.params.penalty_active

    def position_rngs(self, pos0: int, n: int) -> list[np.random.Generator]:
        """One generator per sequence position: a sampled token depends only on
        (seed, position, logits), never on what was drafted around it."""
        return [np.random.default_rng((self.seed, p)) for p in range(pos0, pos0 + n)]

    def push(self, tokens: np.ndarray) -> None:
        if self.windowed and len(tokens):
            self.window = np.concatenate([self.window, tokens])[-self.params.repeat_last_n :]


def top2_margin(rows: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row: how near a tie the argmax was (0 for a tie).

    Two max passes around the argmax, not np.partition: with a large vocabulary (Gemma's 262k) a partition
    per row is dear, and it is charged to every emitted token of a bench run (record_margins), deflating every
    configuration's speed and speculation's ratios most.

    >>> top2_margin(np.array([[1.0, 5.0, 3.5], [2.0, 2.0, 0.0]], dtype=np.float32))
    array([1.5, 0. ], dtype=float32)
    """
    top = np.argmax(rows, axis=1)
    out = np.empty(len(rows), dtype=np.float32)
    for r, i in enumerate(top):
        row = rows[r]
        second = max(row[:i].max(initial=-np.inf), row[i + 1 :].max(initial=-np.inf))
        out[r] = row[i] - second
    return out


def emitted_margins(rows: np.ndarray, masked: list | None) -> np.ndarray:
    """top2_margin of each emitted token's row; where a grammar overrode the argmax (`masked[i]`: row i with the
    disallowed tokens masked, else None), the margin over the allowed tokens. Entries of `masked` past the
    rows are ignored.

    >>> emitted_margins(np.array([[1.0, 5.0, 3.5], [2.0, 0.0, 1.0]], np.float32), [np.array([1.0, -np.inf, 3.5])])
    array([2.5, 1. ], dtype=float32)
    """
    margins = top2_margin(rows)
    for i, m in enumerate((masked or [])[: len(rows)]):
        if m is not None:
            margins[i] = top2_margin(m[None, :])[0]
    return margins


def verify_pads(items: list[StepItem], buckets: tuple[int, ...], n_batch: int,
                n_ctx_seq: int | None) -> dict[int, int]:
    """Pad rows per sequence under shape-stable verifies (seq_id -> rows after its own; none: not padded): in a
    decode-only round (every item one committed token + its draft) all verifies are padded to one bucket
    (verify_shape.padded_rows); prompt-chunk rounds, and rounds where a padded verify would pass a sequence's
    context (n_ctx_seq; None: not known), are not.

    >>> its = [StepItem(0, np.array([5, 6, 7], np.int32), 10, n_draft=2), StepItem(1, np.array([9], np.int32), 4)]
    >>> verify_pads(its, (4, 8), 512, None), verify_pads(its, (4, 8), 512, 12)
    ({0: 1, 1: 3}, {})
    """
    if any(not it.sample or it.n_commit != 1 for it in items):
        return {}
    real = [len(it.tokens) for it in items]
    padded = padded_rows(real, buckets, n_batch)
    if n_ctx_seq is not None and any(it.pos0 + n > n_ctx_seq for it, n in zip(items, padded)):
        return {}
    return {it.seq_id: n - r for it, n, r in zip(items, padded, real) if n > r}


def pack_decodes(items: list[StepItem], n_batch: int) -> list[list[StepItem]]:
    """Split items, in order, into decodes of at most n_batch tokens, keeping each item whole (ValueError for an
    item longer than n_batch).

    >>> its = [StepItem(i, np.zeros(n, np.int32), 0) for i, n in enumerate((300, 200, 100))]
    >>> [[it.seq_id for it in g] for g in pack_decodes(its, 512)]
    [[0, 1], [2]]
    """
    groups: list[list[StepItem]] = [[]]
    used = 0
    for it in items:
        n = len(it.tokens)
        if n > n_batch:
            raise ValueError(f"item of {n} tokens exceeds n_batch {n_batch}")
        if used + n > n_batch:
            groups.append([])
            used = 0
        groups[-1].append(it)
        used += n
    return [g for g in groups if g]


@dataclass
class _Round:
    """One step's working state, as TargetRunner.step's stages hand it on."""

    order: list[int]  # the items' seq ids, as given: the results' order
    groups: list[list[StepItem]]  # the items to decode, one list per llama_decode
    pads: dict[int, int]  # seq_id -> pad rows after its own (shape-stable verifies)
    results: dict[int, StepResult]
    rollback_before: RollbackStats | None  # the rollback counters before the round (a recurrent target)
    hidden: list | None  # (seq_id, pos0, tokens, rows) of committed tokens, where a speculator wants them
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    instrument_seconds: float = 0.0  # record_margins' margins, within verify_seconds until _finish
    sizes: list[int] = field(default_factory=list)  # tokens per llama_decode
    seqs: list[int] = field(default_factory=list)  # sequences per llama_decode
    branch_ids: dict[int, list[int]] = field(default_factory=dict)  # a tree item's seq id -> each branch's seq id
    instrument0: float = 0.0  # TargetRunner.instrument_seconds when the round began
    pad_errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why its tile pads' cells stayed


@dataclass
class _Launched:
    """The round's last decode, started (TargetRunner.launch) and not yet read (collect)."""

    rnd: _Round
    batch: Any = None  # None: the round has no decode (every item failed before it)
    want_rows: bool = False
    t0: float = 0.0


def _with_replay(it: StepItem, tokens: np.ndarray, pos0: int, n_replay: int) -> StepItem:
    """`it` with `n_replay` rows replayed in front of its own (tokens: those rows, then its own)."""
    return StepItem(it.seq_id, tokens, pos0, it.n_draft, it.sample, it.hidden, n_replay, tile_pad=it.tile_pad)


class TargetRunner:
    def __init__(self, ctx: TargetContext, record_margins: bool = False,
                 verify_buckets: tuple[int, ...] | None = None, rollback: StateRollback | None = None,
                 constraints: ConstraintFactory | None = None, branch_seqs: range = range(0),
                 attention_tile: int = 0) -> None:
        """attention_tile: rows of the attention kernel's tile that rounds may be padded to
        (TargetMemory.attention_tile; 0: none), which `calibrate_cost` then prices."""
        self.ctx = ctx
        self.attention_tile = attention_tile
        # sequence ids beyond the slots for draft trees' branches (engine/draft_tree.py), lent per round
        self.branch_seqs = branch_seqs
        if len(branch_seqs) and (verify_buckets is not None or (rollback is not None and rollback.mode != "trim")):
            raise ValueError("draft trees need a target trimmed by position and unpadded verifies")
        self.tree_items = 0  # items verified as trees
        # builds a sequence's grammar state (specray.native.grammar.GrammarCompiler); None: grammars refused
        self.constraints = constraints
        # how rejected rows leave the sequence's memory (a KV cache: trimmed; a recurrent state: rollback.py)
        self.rollback = rollback or StateRollback()
        if self.rollback.mode != "trim" and verify_buckets is not None:
            raise ValueError("shape-stable verifies pad every verify with rows that are then rejected: a recurrent "
                             "target would roll its state back every round (use verify_shape exact)")
        self.record_margins = record_margins
        self.instrument_seconds = 0.0  # time in record_margins' margins so far (StepOutput.instrument_seconds)
        # shape-stable verifies (EngineConfig.shape_buckets): decode-only rounds padded to a bucket; None: off
        self.verify_buckets = verify_buckets
        self.pad_rows = 0  # pad rows decoded (and removed again) so far
        self.tile_pad_rows = 0  # attention tile pad rows decoded (and removed again) so far (StepItem.tile_pad)
        # hidden-row taps (specray.native.hidden.HiddenOutput), set when a hidden-state speculator is configured;
        # switched on only for decodes holding an item with hidden=True
        self.hidden_out = None
        self.hidden_rows = 0  # hidden rows returned (committed tokens of hidden=True items)
        self.sessions: dict[int, _Session] = {}
        self.stashed: dict[int, Any] = {}  # host-tier key -> a saved sequence's cells (stash / restore)
        # since the last StepOutput: bytes saved per key, and restores (key, seconds, made)
        self._stash_sizes: dict[int, int] = {}
        self._restored: list[tuple[int, float, bool]] = []
        self.rounds = 0
        self.multi_seq_decodes = 0  # decodes that held rows of >= 2 sequences
        self.max_seqs_in_decode = 0
        self.step_decodes = 0  # decodes run by step() (calibration excluded)
        self.step_decode_seqs = 0  # sequences summed over those decodes: / step_decodes = mean batch width
        self._launched: _Launched | None = None  # an overlapped round's started decode (launch / collect)

    def start(self, seq_id: int, params: SamplingParams, prompt: np.ndarray, n_keep: int = 0,
              copy_from: int | None = None, restore: int | None = None,
              share: tuple[int, int] | None = None) -> None:
        """Register a sequence whose first `n_keep` prompt tokens are already in its slot's KV cells (the
        prompt cache: the scheduler knows they match); every cell past them is dropped. `copy_from`: the slot
        whose cells are copied in first (another sequence, running or idle, holding the same prefix). `restore`:
        the host-tier key whose saved cells are written in first (`stash`); where they cannot be (no run of free
        cells long enough), the first `n_keep` prompt tokens are prefilled here instead, so the cells are what
        the scheduler was told either way. `share` (slot, n), with `restore` in one KV pool: that slot holds the
        first n of those tokens, and the sequence sees its cells in place of its own copy of them (one pool:
        no second copy of a shared system prompt)."""
        if copy_from is not None:
            self.ctx.clear_seq(seq_id)
            # the whole sequence (a copy across KV streams must be whole); the cells past n_keep go below
            self.ctx.seq_cp(copy_from, seq_id, -1, -1)
        if restore is not None and n_keep > 0:
            t0 = time.perf_counter()
            made = self.restore(seq_id, restore)
            self._restored.append((restore, time.perf_counter() - t0, made))
            if not made:
                self._prefill_quietly(seq_id, np.asarray(prompt[:n_keep], dtype=np.int32))
            if share is not None:
                src, n = share
                self.ctx.seq_rm(seq_id, 0, n)
                self.ctx.seq_cp(src, seq_id, 0, n)
        if n_keep <= 0:
            self.ctx.clear_seq(seq_id)
        elif not self.ctx.seq_rm(seq_id, n_keep, -1):
            # a recurrent state cannot be cut back to a prefix: continuing would decode on the wrong state
            raise RuntimeError(f"the target cannot keep {n_keep} cached tokens of slot {seq_id} (partial KV removal "
                               "refused): turn the prompt cache off for this model")
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (1 << 63))
        self.rollback.forget(seq_id)
        self._drop_constraint(seq_id)
        constraint = None
        if params.grammar is not None:
            if self.constraints is None:
                raise ValueError("this target cannot apply grammars (no constraint factory)")
            constraint = self.constraints(params.grammar)
        sess = _Session(params, seed, np.zeros(0, dtype=np.int32),
                        np.asarray(prompt, dtype=np.int32) if params.prompt_logprobs else None, constraint)
        if n_keep > 0:  # the repetition penalty's window would have seen the reused tokens
            sess.push(np.asarray(prompt[:n_keep], dtype=np.int32))
        self.sessions[seq_id] = sess

    def release(self, seq_id: int, keep: int = 0) -> None:
        """The sequence is done (or cancelled): free its KV cells but the first `keep` (the prompt cache keeps
        them for a later prompt with the same prefix)."""
        self._drop_constraint(seq_id)
        self.sessions.pop(seq_id, None)
        self.rollback.forget(seq_id)
        if keep <= 0 or not self.ctx.seq_rm(seq_id, keep, -1):
            self.ctx.clear_seq(seq_id)

    # ---- the prompt cache's host tier (engine/host_tier.py: the scheduler's index decides, the bytes stay here) --
    def stash(self, seq_id: int, key: int) -> None:
        """Save seq_id's cells to host memory under `key`; the bytes held (0: nothing was saved) come back in
        the next StepOutput.stashed."""
        buf = self.ctx.save_seq(seq_id)
        if buf is not None:
            self.stashed[key] = buf
        self._stash_sizes[key] = 0 if buf is None else len(buf)

    def take_host_report(self) -> tuple[dict[int, int], list[tuple[int, float, bool]]]:
        """Since the last call: bytes saved per key, and the restores made (StepOutput.stashed, restored)."""
        out = self._stash_sizes, self._restored
        self._stash_sizes, self._restored = {}, []
        return out

    def restore(self, seq_id: int, key: int) -> bool:
        """Write the cells saved under `key` into seq_id (its own cells dropped first); False, seq_id left empty,
        where the target has no room for them or no such entry."""
        buf = self.stashed.get(key)
        return buf is not None and self.ctx.load_seq(seq_id, buf)

    def drop_stash(self, keys: list[int]) -> None:
        """Free the host memory of these saved prefixes (unknown keys are ignored); the context may keep a
        buffer of theirs for its next saves (Context.recycle; StepOutput.host_kept reports their bytes)."""
        for k in keys:
            buf = self.stashed.pop(k, None)
            if buf is not None:
                self.ctx.recycle(buf)

    def _prefill_quietly(self, seq_id: int, tokens: np.ndarray) -> None:
        """Decode `tokens` into seq_id's cells from position 0, outside any round (a restore that could not be
        made); their logits are not used."""
        batch = self.ctx.batch
        for p0 in range(0, len(tokens), self.ctx.n_batch):
            part = tokens[p0 : p0 + self.ctx.n_batch]
            batch.clear()
            batch.add_seq(seq_id, part, p0, 1)
            self.ctx.decode(batch)

    def _drop_constraint(self, seq_id: int) -> None:
        sess = self.sessions.get(seq_id)
        if sess is not None and sess.constraint is not None:
            sess.constraint.close()
            sess.constraint = None

    def step(self, items: list[StepItem]) -> StepOutput:
        """Decode every item's rows, verify drafts, roll back rejected rows; one StepResult per item, in the
        items' order. Four stages: `_prepare` (context shifts, replayed rows, pad rows, the items packed into
        decodes of at most n_batch rows) -> per decode, `_decode` (fill the batch, one llama_decode) and
        `_verify` (each item's draft against its rows, rollback, what it emits) -> `_finish` (the output).

        A sequence that cannot go on (its context cannot shift, its state cannot be rolled back, its grammar
        has no allowed token) gets a result with `error` and no tokens; the others are unaffected."""
        rnd = self._prepare(items)
        for group in rnd.groups:
            self._verify_timed(group, *self._decode(group, rnd), rnd)
        rnd.instrument_seconds = self.instrument_seconds - rnd.instrument0
        return self._finish(rnd)

    def launch(self, items: list[StepItem]) -> None:
        """`step`'s first half, for a round whose host work overlaps the target's decode: the round prepared,
        every decode but its last run and verified, the last one started (`ctx.launch`: on a GPU it returns once
        the graph is queued; on CPU once it is done, so there the caller does its work on another thread).
        `collect` then waits for it and returns what `step` would have. In between, nothing may call this runner
        or touch its context: the caller does work that needs neither.
        """
        if self._launched is not None:
            raise RuntimeError("a launched round was not collected")
        rnd = self._prepare(items)
        for group in rnd.groups[:-1]:
            self._verify_timed(group, *self._decode(group, rnd), rnd)
        if not rnd.groups:
            self._launched = _Launched(rnd)
            return
        batch = self._fill(rnd.groups[-1], rnd)
        want_rows = self._want_rows(rnd.groups[-1], rnd)
        t0 = time.perf_counter()
        self.ctx.launch(batch)
        self._launched = _Launched(rnd, batch, want_rows, t0)

    def collect(self) -> StepOutput:
        """`step`'s second half: waits for the decode `launch` started, verifies its items and returns the round's
        output (its decode time counts from the launch to the logits being read: what the round waited, the host
        work done meanwhile included). A failed decode raises here, as in `step`."""
        launched, self._launched = self._launched, None
        if launched is None:
            raise RuntimeError("collect without launch")
        rnd = launched.rnd
        if launched.batch is not None:
            logits = self.ctx.logits(launched.batch.n_outputs)
            rnd.decode_seconds += time.perf_counter() - launched.t0
            taps = self._count(rnd.groups[-1], rnd, launched.batch, launched.want_rows, launched.t0)
            self._verify_timed(rnd.groups[-1], logits, taps, rnd)
        rnd.instrument_seconds = self.instrument_seconds - rnd.instrument0
        return self._finish(rnd)

    def _verify_timed(self, group: list[StepItem], logits: np.ndarray, taps: np.ndarray | None, rnd: _Round) -> None:
        t0 = time.perf_counter()
        self._verify(group, logits, taps, rnd)
        rnd.verify_seconds += time.perf_counter() - t0

    def _prepare(self, items: list[StepItem]) -> _Round:
        """The round's decodes: context shifts applied, a rolled-back sequence's replayed rows put in front of
        its own (rollback.py), pad rows chosen (shape-stable verifies), the items packed into decodes of at most
        n_batch rows. A sequence whose shift or replay fails gets its error result here and is not decoded."""
        results: dict[int, StepResult] = {}
        before = RollbackStats(**self.rollback.stats.to_dict()) if self.rollback.mode != "trim" else None
        order = [it.seq_id for it in items]
        items = self._shift(items, results)
        items, failed = self.rollback.prepare(items, _with_replay)
        for seq_id, why in failed.items():
            results[seq_id] = StepResult(seq_id, np.zeros(0, dtype=np.int32), error=why)
        pads = {} if self.verify_buckets is None else verify_pads(
            items, self.verify_buckets, self.ctx.n_batch, getattr(self.ctx, "n_ctx_seq", None))
        self.pad_rows += sum(pads.values())
        items, branch_ids = self._lend_branch_ids(items)
        groups = pack_decodes(items, self.ctx.n_batch)
        hidden: list | None = [] if self.hidden_out is not None and any(it.hidden for it in items) else None
        return _Round(order, groups, pads, results, before, hidden, branch_ids=branch_ids,
                      instrument0=self.instrument_seconds)

    def _lend_branch_ids(self, items: list[StepItem]) -> tuple[list[StepItem], dict[int, list[int]]]:
        """Each tree item's sequence ids, one per branch (its own for the main draft, spare ones for the
        others), each spare one first made to see the sequence's cells (in one KV pool a copy is metadata only).
        A tree the spare ids cannot cover, or one of a sequence that is not one committed row followed by its
        draft, goes as its main draft alone."""
        spare = list(self.branch_seqs)
        out, lent = [], {}
        for it in items:
            tree = it.tree
            if tree is None:
                out.append(it)
                continue
            if tree.n_branches - 1 > len(spare) or it.n_commit != 1 or it.hidden:
                main = tree.tokens[: tree.n_main]
                out.append(StepItem(it.seq_id, np.concatenate([it.tokens[:1], main]), it.pos0, len(main),
                                    it.sample, it.hidden, it.n_replay, it.shift))
                continue
            ids = [it.seq_id] + spare[: tree.n_branches - 1]
            del spare[: tree.n_branches - 1]
            for b in ids[1:]:
                self.ctx.seq_rm(b, -1, -1)
                self.ctx.seq_cp(it.seq_id, b, -1, -1)
            lent[it.seq_id] = ids
            out.append(it)
        return out, lent

    def _decode(self, group: list[StepItem], rnd: _Round) -> tuple[np.ndarray, np.ndarray | None]:
        """One llama_decode of `group`'s rows (each item's pad rows after its own), counted. Returns its logits
        rows, each item's in turn: its echo rows (SamplingParams.prompt_logprobs), then, sampled, n_draft + 1
        verify rows and its pad rows; and, where an item wants hidden rows, the decode's hidden rows (one per
        token; None else). Both are views of llama.cpp's buffers, valid until the next decode."""
        batch = self._fill(group, rnd)
        want_rows = self._want_rows(group, rnd)
        t0 = time.perf_counter()
        logits = self.ctx.decode(batch)
        rnd.decode_seconds += time.perf_counter() - t0
        return logits, self._count(group, rnd, batch, want_rows, t0)

    def _fill(self, group: list[StepItem], rnd: _Round) -> Any:
        """The context's batch, holding `group`'s rows."""
        batch = self.ctx.batch
        batch.clear()
        for it in group:
            pad = rnd.pads.get(it.seq_id, 0)
            # pad rows get logits: n_outputs is shape; echo: every prompt row but the sampled one too
            n_logits = (it.n_draft + 1 + pad if it.sample else 0) + self._echo_rows(it)
            # pad token: the last real token repeated. Any valid id would do (its logits are never read, its
            # cells are removed in _verify); this one is valid for every vocabulary and costs no look-up
            ids = rnd.branch_ids.get(it.seq_id)
            if ids is not None:  # a tree: the root row on every branch, each node on the branches through it
                tree = it.tree
                pos = np.concatenate([[it.pos0], it.pos0 + 1 + tree.depths]).astype(np.int32)
                batch.add_rows(it.tokens, pos, [[ids[b] for b in row] for row in tree.row_branches()])
                continue
            toks = np.concatenate([it.tokens, np.full(pad, it.tokens[-1], dtype=np.int32)]) if pad else it.tokens
            batch.add_seq(it.seq_id, toks, it.pos0, n_logits)
        for it in group:  # after every output row: the logits rows keep their order
            if it.tile_pad:
                batch.add_seq(it.seq_id, np.full(it.tile_pad, it.tokens[-1], dtype=np.int32),
                              it.pos0 + len(it.tokens) + rnd.pads.get(it.seq_id, 0), 0)
        return batch

    def _want_rows(self, group: list[StepItem], rnd: _Round) -> bool:
        """Whether the decode of `group` returns hidden rows (taps switched on for it, or off)."""
        want_rows = rnd.hidden is not None and any(it.hidden for it in group)
        if self.hidden_out is not None:
            self.hidden_out.set_enabled(want_rows)
        return want_rows

    def _count(self, group: list[StepItem], rnd: _Round, batch: Any, want_rows: bool,
               t0: float) -> np.ndarray | None:
        """A decode of `group` is done: its hidden rows read (None where none are wanted), its tile pads' cells
        dropped, and it is counted."""
        taps = self.hidden_out.rows(batch.n_tokens) if want_rows else None
        for it in group:
            if it.tile_pad:
                self._drop_tile_pad(it, rnd)
        rnd.sizes.append(batch.n_tokens)
        rnd.seqs.append(len(group))
        self.step_decodes += 1
        self.step_decode_seqs += len(group)
        if len(group) > 1:
            self.multi_seq_decodes += 1
        self.max_seqs_in_decode = max(self.max_seqs_in_decode, len(group))
        replay_rows = sum(it.n_replay for it in group)
        if replay_rows:  # their share of this decode, by rows
            self.rollback.stats.replay_rows += replay_rows
            self.rollback.stats.replay_seconds += (time.perf_counter() - t0) * replay_rows / batch.n_tokens
        return taps

    def _drop_tile_pad(self, it: StepItem, rnd: _Round) -> None:
        """The cells of `it`'s tile pads leave its memory; where the target refuses, the sequence ends (its cache
        would hold tokens it never committed)."""
        first = it.pos0 + len(it.tokens) + rnd.pads.get(it.seq_id, 0)
        self.tile_pad_rows += it.tile_pad
        if not self.ctx.seq_rm(it.seq_id, first, first + it.tile_pad):
            rnd.pad_errors[it.seq_id] = (
                f"sequence {it.seq_id}: the target refused to drop its attention tile pad rows (llama_memory_seq_rm "
                "returned false): its cache would hold tokens it never committed")

    def _verify(self, group: list[StepItem], logits: np.ndarray, taps: np.ndarray | None, rnd: _Round) -> None:
        """Each item of one decode (`_decode`'s logits and hidden rows): its result into rnd.results and, where
        a speculator wants them, its committed tokens' hidden rows into rnd.hidden (a replayed token's went out
        when it was first decoded). Verification never sees a pad row."""
        row = tap = 0  # the item's first logits row, its first token's hidden row
        for it in group:
            pad = rnd.pads.get(it.seq_id, 0)
            echo = self._echo_rows(it)
            n_real = echo + (it.n_draft + 1 if it.sample else 0)
            if it.seq_id in rnd.pad_errors:
                res = StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=rnd.pad_errors[it.seq_id])
            elif it.seq_id in rnd.branch_ids:
                res = self._verify_tree(it, logits[row : row + n_real], rnd.branch_ids[it.seq_id])
            else:
                res = self._verify_item(it, logits[row : row + n_real], echo, pad)
            rnd.results[it.seq_id] = res
            if taps is not None and it.hidden and res.error is None:
                skip, end = (it.n_replay, it.n_commit + res.n_accepted) if it.sample else (0, len(it.tokens))
                rows = taps[tap + skip : tap + end]
                # rows are a view into llama.cpp's buffer: copied if another decode of this step follows
                rnd.hidden.append((it.seq_id, it.pos0 + skip, it.tokens[skip:end],
                                   rows.copy() if len(rnd.groups) > 1 else rows))
            row += n_real + (pad if it.sample else 0)
            tap += len(it.tokens) + pad

    def _verify_item(self, it: StepItem, rows: np.ndarray, echo: int, pad: int) -> StepResult:
        """One item's result from its logits rows (`echo` echo rows, then, sampled, its n_draft + 1 verify rows):
        the prompt's logprobs where asked; a sampled item's draft verified (greedy, or sampled with one generator
        per position), its rejected draft rows and `pad` pad rows rolled back, and what it emits: the accepted
        draft and then the target's own token, with their top-2 margins (record_margins) and logprobs where asked.
        A grammar with no allowed token, or a state that cannot be rolled back, ends the sequence (error)."""
        sess = self.sessions[it.seq_id]
        if sess.windowed:
            sess.push(it.tokens[it.n_replay : it.n_commit])
        plp = None
        if echo:  # row j predicts the prompt token after it
            p0 = it.pos0 + 1
            plp = token_logprobs(rows[:echo], sess.prompt[p0 : p0 + echo], sess.params.logprobs or 0)
        if not it.sample:
            return StepResult(it.seq_id, np.zeros(0, dtype=np.int32), prompt_logprobs=plp)
        k = it.n_draft
        rows = rows[echo:]
        draft = it.tokens[it.n_commit :]
        # the grammar's masked rows where it overrode the argmax: the margins are over allowed tokens
        masked = [] if self.record_margins and sess.constraint is not None else None
        try:
            if sess.params.greedy:
                verdict = verify_greedy(rows, draft, sess.window, sess.params, sess.constraint, masked)
            else:
                # row i predicts the token at position pos0 + n_commit + i
                rngs = sess.position_rngs(it.pos0 + it.n_commit, k + 1)
                verdict = verify_sampled_coupled(rows, draft, sess.params, rngs, sess.window, sess.constraint)
        except ConstraintError as e:  # the grammar cannot go on: this sequence ends with the error
            self.rollback.undo(self.ctx, it, 0, pad)
            return StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=str(e))
        n_acc = verdict.n_accepted
        # rejected draft rows, and pad rows always, leave the sequence's memory
        error = self.rollback.undo(self.ctx, it, n_acc, pad)
        if error is not None:  # nothing may decode on this state: the sequence ends here
            return StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=error)
        out = np.empty(n_acc + 1, dtype=np.int32)
        if n_acc:  # most rows have no accepted draft: no slices to make
            out[:n_acc] = draft[:n_acc]
            if sess.windowed:
                sess.push(out[:n_acc])
        out[n_acc] = verdict.next_token
        margins = self._margins(rows[: n_acc + 1], masked) if self.record_margins else None
        # each emitted token's own row: what target-only decoding would have reported for it
        lps = None if sess.params.logprobs is None else token_logprobs(rows[: n_acc + 1], out, sess.params.logprobs)
        return StepResult(it.seq_id, out, n_acc, margins, n_replay=self.rollback.pending_rows(it.seq_id),
                          logprobs=lps, prompt_logprobs=plp)

    def _verify_tree(self, it: StepItem, rows: np.ndarray, ids: list[int]) -> StepResult:
        """A tree item's result: the longest path the target takes (verify_tree), the accepted cells handed to
        the sequence's own id and every branch id's cells dropped, and what it emits (as _verify_item)."""
        sess = self.sessions[it.seq_id]
        sess.push(it.tokens[:1])
        tree = it.tree
        masked = [] if self.record_margins and sess.constraint is not None else None
        try:
            if sess.params.greedy:
                verdict = verify_tree_greedy(rows, tree, sess.window, sess.params, sess.constraint, masked)
            else:
                rngs = sess.position_rngs(it.pos0 + 1, int(tree.depths.max()) + 2)
                verdict = verify_tree_sampled(rows, tree, sess.params, rngs, sess.window, sess.constraint)
        except ConstraintError as e:
            self._keep_tree_path(it, ids, TreeVerdict([], 0, 0))
            return StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=str(e))
        error = self._keep_tree_path(it, ids, verdict)
        if error is not None:
            return StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=error)
        self.tree_items += 1
        n_acc = verdict.n_accepted
        out = np.empty(n_acc + 1, dtype=np.int32)
        out[:n_acc] = tree.tokens[verdict.path]
        out[n_acc] = verdict.next_token
        sess.push(out[:n_acc])
        margins = lps = None
        if self.record_margins or sess.params.logprobs is not None:
            # each emitted token's row: a copy of whole vocabulary rows, so only where something reads them
            own = rows[[0] + [1 + n for n in verdict.path]]
            margins = self._margins(own, masked) if self.record_margins else None
            lps = None if sess.params.logprobs is None else token_logprobs(own, out, sess.params.logprobs)
        return StepResult(it.seq_id, out, n_acc, margins, logprobs=lps, branch=verdict.branch)

    def _margins(self, rows: np.ndarray, masked: list | None) -> np.ndarray:
        """emitted_margins, timed as the bench's instrumentation (instrument_seconds): no server computes them, so
        the round's host time leaves them out (round_stages.INSTRUMENT)."""
        t0 = time.perf_counter()
        margins = emitted_margins(rows, masked)
        self.instrument_seconds += time.perf_counter() - t0
        return margins

    def _keep_tree_path(self, it: StepItem, ids: list[int], verdict: TreeVerdict) -> str | None:
        """The accepted path's cells become the sequence's own, the rest of the tree goes, and the branch ids
        are left empty. The path lies on branch verdict.branch: the sequence's own id holds it already (the main
        draft), or its cells are copied in from that branch's id."""
        seq, first = it.seq_id, it.pos0 + 1  # the first draft position
        n = verdict.n_accepted
        owner = ids[verdict.branch]
        ok = self.ctx.seq_rm(seq, first + n if owner == seq else first, -1)
        if owner != seq and n:
            self.ctx.seq_cp(owner, seq, first, first + n)
        for b in ids[1:]:
            ok = self.ctx.seq_rm(b, -1, -1) and ok
        if not ok:
            return (f"sequence {seq}: the target refused to drop a draft tree's rejected cells (llama_memory_seq_rm "
                    "returned false): its cache would hold tokens the target never committed")
        return None

    def _finish(self, rnd: _Round) -> StepOutput:
        """The round's output: the results in the items' order, its decodes and their time, its verify time,
        its rollback work (a recurrent target) and the committed tokens' hidden rows, packed (HiddenRows)."""
        self.rounds += 1
        out = StepOutput([rnd.results[seq_id] for seq_id in rnd.order], rnd.decode_seconds, sum(rnd.sizes),
                         len(rnd.groups), rnd.sizes, rnd.seqs,
                         verify_seconds=rnd.verify_seconds - rnd.instrument_seconds,
                         instrument_seconds=rnd.instrument_seconds)
        out.stashed, out.restored = self.take_host_report()
        out.host_kept = self.ctx.recycled_bytes()
        if rnd.rollback_before is not None:
            out.rollback = self.rollback.stats.minus(rnd.rollback_before)
        if rnd.hidden:
            h = self.hidden_out
            out.hidden = pack_rows(self.rounds, h.taps, h.tap_widths, rnd.hidden)
            self.hidden_rows += out.hidden.n_rows
        return out

    def _shift(self, items: list[StepItem], results: dict[int, StepResult]) -> list[StepItem]:
        """Apply the items' context shifts to the KV cache (seq_rm + seq_add); an item whose sequence cannot
        shift fails with an error result (its rows would land on cells still in use)."""
        kept = []
        for it in items:
            if it.shift is not None and not self.ctx.shift_seq(it.seq_id, *it.shift):
                results[it.seq_id] = StepResult(it.seq_id, np.zeros(0, dtype=np.int32), error=(
                    "context_shift: the target's memory cannot shift positions (a recurrent or hybrid model)"))
                continue
            kept.append(it)
        return kept

    def calibrate_cost(self) -> dict:
        """What the cost model starts from (target_calibration.calibrate_cost). Slot 0 must be idle, and slot 1
        where the attention tile is priced."""
        return calibrate_cost(self.ctx, self.attention_tile)

    def measure_decode_costs(self, sizes: tuple[int, ...] = DECODE_SIZES, reps: int = 5) -> dict[int, float]:
        return measure_decode_costs(self.ctx, sizes, reps)

    def measure_attention_cost(self) -> float:
        return measure_attention_cost(self.ctx)

    def _echo_rows(self, it: StepItem) -> int:
        """Leading logits rows of `it` for its prompt's own logprobs (echo requests' prompt chunks; else 0)."""
        sess = self.sessions.get(it.seq_id)
        if sess is None or sess.prompt is None or it.n_draft:
            return 0
        return prompt_rows(len(it.tokens), it.pos0, len(sess.prompt), it.sample)
