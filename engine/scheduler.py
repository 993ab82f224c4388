"""The round scheduler (router side): slots, queue, draft -> verify -> accept -> emit.

One `step()` is one round for every active sequence: queued requests are
admitted into free slots; the draft policy (engine/policy/) gives each
decoding sequence its draft, asked of its chain and cut to what pays; prompt
chunks fill the rest of the batch; ONE call to the target (`target.step`)
decodes and verifies everything; the verdicts go to the chain's speculators
and the policy's estimates; accepted tokens stream out and finished
sequences free their slot.

The target is anything with TargetRunner's `start/step/release` methods: the
in-process runner (co-located mode) or a proxy to the target actor.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .admission_order import ORDER_WINDOW, admission_order
from .chain import Chain
from .config import ChainConfig, EngineConfig
from .constraint import ConstraintFactory
from .context_shift import ContextShifter
from .cost import DecodeCostModel
from .logprobs import TokenLogprobs
from .policy import DraftPolicy, Proposal, Room, SeqDraftRequest
from .prefix_cache import PrefixCache
from .prompt_cache import idle_budget
from .prompt_share import fork_plan, link
from .request import GenerationRequest, Sequence, SeqState, admission_plan
from .rollback import RollbackStats, TargetMemory
from .round_stages import INSTRUMENT, RoundClock
from .target import StepItem, StepOutput, StepResult
from .tile_pads import KernelFit, TileQuote, tile_pad
from .verify_shape import batch_rows, max_draft

log = logging.getLogger("specray.scheduler")


class Tokenizer(Protocol):
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


class Target(Protocol):
    def start(self, seq_id: int, params, prompt: np.ndarray, n_keep: int = 0, copy_from: int | None = None,
              restore: int | None = None) -> None: ...
    def step(self, items: list[StepItem]) -> StepOutput: ...
    def release(self, seq_id: int, keep: int = 0) -> None: ...
    # the prompt cache's host tier (host_cache_bytes > 0 only): save a slot's cells, free saved ones
    def stash(self, seq_id: int, key: int) -> None: ...
    def drop_stash(self, keys: list[int]) -> None: ...


class QueueFullError(RuntimeError):
    """No slot and no queue room: the caller should retry later (HTTP 429/503)."""


@dataclass
class Event:
    """What one round produced for one sequence."""

    seq: Sequence
    tokens: list[int]
    text: str
    finished: bool
    error: str | None = None  # the sequence failed (its state could not be rolled back): it ends with this error
    logprobs: TokenLogprobs | None = None  # of `tokens`, where the request asked for them
    prompt_logprobs: list | None = None  # echo: the prompt's TokenLogprobs chunks, with the sequence's first event


@dataclass
class RoundStats:
    rounds: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    round_seconds: float = 0.0
    # the share of round time spent on prompt rows (by the cost model's price of those rows), so
    # generation speed can be reported without prompt processing, as llama.cpp's timings do
    prefill_seconds: float = 0.0
    # rounds in which every slot was generating and none was prefilling: throughput under full load,
    # free of the tail where the last sequences of a batch run alone
    loaded_seconds: float = 0.0
    loaded_tokens: int = 0
    tokens_emitted: int = 0
    speculator_failures: int = 0
    # seconds by stage of the round (round_stages.py: they add up to round_seconds) and rounds x the sequences
    # decoding in each, for host time per decoding sequence
    stage_seconds: dict[str, float] = field(default_factory=dict)
    seq_rounds: int = 0
    # a recurrent target's state rollbacks (rollback.py): saves, restores, replayed rows
    rollback: RollbackStats = field(default_factory=RollbackStats)
    failed_sequences: int = 0  # sequences ended with an error by the target (a state it could not roll back)
    shared_prompts: int = 0  # sequences that copied a sibling's prompt cells instead of prefilling (n > 1)
    context_shifts: int = 0  # sequences that reached their context and discarded old cells (context_shift.py)
    # the bench's instrumentation inside rounds (record_margins: round_stages.INSTRUMENT), in no stage
    instrument_seconds: float = 0.0
    # overlapped rounds (EngineConfig.overlap): host work done while the target decoded (speculators' set-ups
    # and merges, the last round's events made and delivered), inside the `decode` stage's wall time, in no
    # stage of its own
    overlapped_seconds: float = 0.0
    overlapped_rounds: int = 0
    # rounds padded up to the target's attention tile, and their pad rows (tile_pads.py)
    tile_pads: int = 0
    tile_pad_rows: int = 0

    def add_round(self, clock: RoundClock, prefill_share: float, loaded_tokens: int | None, n_decoding: int) -> None:
        """One round's stamps, `prefill_share` of its time on prompt rows; loaded_tokens: what it emitted if every
        slot was generating (None otherwise)."""
        seconds = clock.work  # the bench's instrumentation is no round's work: kept apart
        self.instrument_seconds += clock.total - seconds
        self.rounds += 1
        self.seq_rounds += n_decoding
        self.round_seconds += seconds
        for k, v in clock.seconds.items():
            if k != INSTRUMENT:
                self.stage_seconds[k] = self.stage_seconds.get(k, 0.0) + v
        self.prefill_seconds += seconds * prefill_share
        if loaded_tokens is not None:
            self.loaded_seconds += seconds
            self.loaded_tokens += loaded_tokens


def prefill_share(price: Callable[[int], float], n_total: int, n_prefill: int) -> float:
    """The share of a round's decode that its prompt rows cost, by the cost model's price of rows.

    >>> round(prefill_share(lambda n: 0.010 + 0.001 * n, 12, 8), 3)   # 8 of 12 rows: (0.022 - 0.014) / 0.022
    0.364
    >>> prefill_share(lambda n: 0.01, 4, 0), prefill_share(lambda n: 0.01, 4, 4)
    (0.0, 1.0)
    """
    if not n_prefill:
        return 0.0
    full = price(n_total)
    return 1.0 if n_total == n_prefill or full <= 0 else (full - price(n_total - n_prefill)) / full


def prompt_chunks(left: list[int], room: int, chunk: int, budget: int | None = None, first: tuple[int, ...] = (),
                  oldest: int | None = None, floor: int = 0) -> list[int]:
    """Rows of each prefilling sequence's prompt this round (`left`: the rows each has left; the answer is in
    the same order, 0 for those that get none): at most `chunk` each, `room` in all, and at most `budget` in all
    (the prompt rows a round carries beside decoding sequences; None: no cap but the room).

    Short prompts go first: a conversation's next turn is a short continuation, and its first token should not
    wait behind other prompts' long chunks. Before them go the sequences in `first` (others wait to copy their
    prefix), and before everything `floor` rows of the `oldest` prompt, so a long prompt progresses every round.

    >>> prompt_chunks([300, 40, 500], room=400, chunk=256)                   # shortest first, up to the room
    [256, 40, 104]
    >>> prompt_chunks([300, 40], room=200, chunk=256, budget=64)             # a budget beside decoding sequences
    [24, 40]
    >>> prompt_chunks([300, 40, 500], room=400, chunk=256, first=(2,))       # one others wait for goes first
    [104, 40, 256]
    >>> prompt_chunks([300, 40, 500], room=400, chunk=256, budget=100, oldest=2, floor=32)
    [28, 40, 32]
    """
    take = min(room, budget) if budget is not None else room
    out = [0] * len(left)
    if oldest is not None and take > 0:
        out[oldest] = min(floor, left[oldest], chunk, take)
        take -= out[oldest]
    order = [*first, *sorted((i for i in range(len(left)) if i not in first), key=lambda i: (left[i], i))]
    for i in order:
        if take <= 0:
            break
        n = min(chunk - out[i], left[i] - out[i], take)
        out[i] += n
        take -= n
    return out


def step_items(decoding: list[Sequence], proposals: list[Proposal], chunks: list[tuple[Sequence, int]],
               needs_hidden: Callable[[Sequence], bool]) -> list[StepItem]:
    """The target's rows of one round: [last token + draft] per decoding sequence, then the prompt chunks."""
    items: list[StepItem] = []
    for s, prop in zip(decoding, proposals):
        draft = prop.tokens if prop.tree is None else prop.tree.tokens
        toks = np.empty(1 + len(draft), dtype=np.int32)
        toks[0] = s.last_token
        toks[1:] = draft
        items.append(StepItem(s.slot, toks, s.n_past, len(draft), True, needs_hidden(s), shift=s.take_shift(),
                              tree=prop.tree))
    for s, n in chunks:
        end = s.n_prefilled + n
        items.append(StepItem(s.slot, s.req.prompt_tokens[s.n_prefilled : end], s.n_prefilled, 0,
                              end == len(s.req.prompt_tokens), needs_hidden(s)))
    return items


#: prompt rows the oldest prefilling sequence gets every round whatever shorter prompts take first
PREFILL_FLOOR = 32

#: a sequence replaying more rows than this (rollback.py: consecutive rollbacks add up) sends no draft until the
#: replay has gone through, so a run of rejections cannot grow it without bound
MAX_REPLAY_TO_DRAFT = 16

#: rounds whose timing is learnt together when rounds do not overlap: one round's learning, run after a decode,
#: finds its code and the price models out of the CPU's caches, and the rounds after it in the same batch find
#: them warm; prices a few rounds old plan as well (they move over hundreds of rounds)
LEARN_BATCH = 8


def draft_requests(decoding: list[Sequence], disabled: set[str], n_ctx: int,
                   buckets: tuple[int, ...] | None, cap: int | None = None,
                   tree: Callable[[Sequence], bool] = lambda s: False) -> list[SeqDraftRequest]:
    """Each decoding sequence's draft request: its chain less the disabled speculators, and the most draft
    tokens its tokens left and context allow (with shape-stable verifies, at most the largest bucket's; at most
    `cap`, the target's rollback limit; none while it replays more than MAX_REPLAY_TO_DRAFT rows); `tree(s)`:
    whether its draft may be a tree."""
    reqs = []
    for s in decoding:
        chain = tuple(n for n in s.chain if n not in disabled)
        n_max = max(0, min(s.n_max, s.tokens_left - 1, n_ctx - s.n_past - s.replay_rows - 2))
        if buckets is not None:  # every decode-only round's shape stays in the bucket set
            n_max = min(n_max, max_draft(buckets))
        if cap is not None:
            n_max = min(n_max, cap)
        if s.replay_rows > MAX_REPLAY_TO_DRAFT:
            n_max = 0
        # model speculators' caches are by KV position: after a context shift they draft from the shifted tokens
        reqs.append(SeqDraftRequest(s.slot, chain, s.history_view(), n_max, s.tokens_left, s.req.tune_class,
                                    kv_history=s.kv_history() if s.shift_keep is not None else None,
                                    replay_rows=s.replay_rows, tree=tree(s)))
    return reqs


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share.

    >>> common_prefix(np.array([1, 2, 3]), np.array([1, 2, 9, 4])), common_prefix(np.array([5]), np.array([6]))
    (2, 0)
    """
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def commit_round(verdict: Callable[[Proposal, int, int, np.ndarray], None], decoding: list[Sequence],
                 proposals: list[Proposal], chunks: list[tuple[Sequence, int]], items: list[StepItem],
                 results: list[StepResult], mirror: Callable[[Sequence, np.ndarray, int], None]) -> tuple[list, list]:
    """Take a round's results into its sequences: each decoding sequence's verdict (`verdict(proposal,
    n_drafted, n_accepted, emitted)`: its speculators and the policy told, its committed tokens mirrored, its
    position moved on) and each prompt chunk's progress. Returns ([(sequence, result) to emit], [(sequence,
    error)] for those the target could not go on with (a state it could not roll back: they end with that
    error, every other sequence goes on)."""
    failed = [(s, r.error) for s, r in zip(decoding + [s for s, _ in chunks], results) if r.error]
    emit: list[tuple[Sequence, StepResult]] = []
    for s, prop, res, it in zip(decoding, proposals, results[: len(decoding)], items):
        if res.error:
            continue
        s.replay_rows = res.n_replay
        n_drafted = len(prop.tokens)
        # the main draft's tokens the target kept: a tree's accepted path may leave it for a runner-up
        n_main = res.n_accepted if prop.tree is None else common_prefix(prop.tokens, res.tokens)
        try:
            verdict(prop, n_drafted, n_main, res.tokens)
        except Exception:
            log.exception("speculator accept failed")
        committed = it.tokens[: 1 + res.n_accepted] if prop.tree is None else np.concatenate(
            [it.tokens[:1], res.tokens[: res.n_accepted]])
        mirror(s, committed, it.pos0)
        s.count_spec(prop.speculator, prop.rows, res.n_accepted)
        s.n_past += 1 + res.n_accepted
        s.rounds += 1
        emit.append((s, res))
    for (s, n), res in zip(chunks, results[len(decoding) :]):
        if res.error:
            continue
        mirror(s, s.req.prompt_tokens[s.n_prefilled : s.n_prefilled + n], s.n_prefilled)
        if res.prompt_logprobs is not None:
            s.prompt_logprobs.append(res.prompt_logprobs)
        s.n_prefilled += n
        s.n_past += n
        if len(res.tokens):
            s.state = SeqState.DECODING
            emit.append((s, res))
    return emit, failed


def _learn_verdict(policy: DraftPolicy, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray) -> None:
    """An overlapped round's verdict into the policy (DraftPolicy.learn): a failure is logged, as the verdict's
    telling is in commit_round, and the rounds go on."""
    try:
        policy.learn(prop, n_drafted, n_accepted, emitted)
    except Exception:
        log.exception("the policy's learning from a verdict failed")


def _same(e: Event) -> Event:
    return e


def _event(s: Sequence, kept: list[int], text, lps, plp, finished: bool) -> Event:
    """An overlapped round's event, made while the next round decodes (its text decoded now where it waited)."""
    return Event(s, kept, text if isinstance(text, str) else text(), finished, logprobs=lps, prompt_logprobs=plp)


def check_grammar(constraints: ConstraintFactory | None, grammar: str | None) -> None:
    """ValueError if a request's grammar does not compile: checked at submit, so a bad one never reaches a round."""
    if grammar is not None:
        if constraints is None:
            raise ValueError("this engine cannot apply grammars")
        constraints(grammar).close()


class Scheduler:
    def __init__(
        self, config: EngineConfig, target: Target, tokenizer: Tokenizer, chain: Chain, n_ctx: int,
        cost: DecodeCostModel | None = None, shared_cells: int | None = None, memory: TargetMemory | None = None,
        constraints: ConstraintFactory | None = None, host_cache_bytes: int = 0,
    ) -> None:
        """n_ctx: KV cells one sequence may use. shared_cells: all slots' cells (unified KV cache), or None.
        memory: the target's memory kind and rollback mode (rollback.py; default: an attention KV cache).
        constraints: compiles requests' grammars (None: refused). host_cache_bytes: the prompt cache's host
        tier budget (0: none; the target must then have `stash` and `drop_stash`)."""
        self.config, self.constraints = config, constraints
        self.memory = memory or TargetMemory()
        self.target, self.tok, self.chain, self.n_ctx = target, tokenizer, chain, n_ctx
        # context shift (opt-in): refused here for a target that cannot shift (ValueError)
        self.shifter = ContextShifter(config, self.memory, n_ctx, getattr(tokenizer, "bos", None))
        self.shared_cells = shared_cells
        # which drafts are sent and how much of each: prices, estimates, gate, tuning and planner (engine/policy/)
        self.policy = DraftPolicy(chain, cost or DecodeCostModel(), self.memory.rollback)
        self.free_slots: list[int] = list(range(config.slots))[::-1]
        # one prefix cache for the engine: idle slots' KV, running sequences' cells, a host tier (prefix_cache.py)
        # (a recurrent state cannot be cut back to a shared prefix: no prompt cache on such targets)
        self.prefix_cache = PrefixCache(target, config.prompt_cache and self.memory.keeps_prefix, shared_cells,
                                        host_cache_bytes, self._prefill_seconds)
        self.active: dict[int, Sequence] = {}  # slot -> seq
        self.prompt_groups: dict[str, Sequence] = {}  # share_prompt key -> the group's first sequence
        self.queue: deque[Sequence] = deque()
        self.reserved = 0  # KV cells reserved by active sequences (without sharing: prefix_cache counts shares)
        self.awaited: set[int] = set()  # slots of prefilling sequences whose prefix queued ones wait to copy
        self.stats = RoundStats()
        self.rounds_run = 0  # rounds step() has run, counted as each starts (stats.rounds: as each is learnt)
        # how far the attention kernels' start-up prices miss where rounds run (tile_pads.py)
        self.tile_fit = KernelFit()
        self.disabled_speculators: set[str] = set()
        self.on_event: Callable[[Event], None] | None = None
        # called after on_event has had a batch of events (an overlapped round's, made while the target decodes)
        self.on_delivered: Callable[[], None] | None = None
        # overlapped rounds (use_overlap): a round's events are made (text decoded) and delivered, model-free
        # speculators set up and merge sequences, and the round's stats and prices are learnt, while the next
        # round decodes
        self.overlap = False
        self._beside: ThreadPoolExecutor | None = None  # where that work runs while a CPU decode blocks
        self._later: list[Callable[[], Event]] = []  # the last round's events, not made yet
        self._chain_later: list[Callable[[], None]] = []  # speculators' set-ups and merges, not run yet
        # the last round's learning, not run yet: the policy's from its verdicts (and the slots it forgets, in
        # order with them), its stats and prices
        self._learn_later: list[Callable[[], None]] = []
        self._made: list[Event] = []  # events made and delivered, not yet returned by step()

    # the target decode's price model (the policy's; settable)
    cost = property(lambda self: self.policy.cost, lambda self, model: setattr(self.policy, "cost", model))

    # ---- admission ---------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> tuple[tuple[str, ...], int, int]:
        """Check a request; return (chain, n_max, KV cells it needs). Raises ValueError."""
        chain, n_max, need = admission_plan(req, self.config.chain, self.n_ctx, self.shifter.enabled(req))
        try:
            self.chain.validate(chain)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e)) from None
        check_grammar(self.constraints, req.sampling.grammar)
        if (buckets := self.config.shape_buckets) is not None:
            # shape-stable verifies: a round may pad this sequence's verify to the largest bucket (another
            # sequence's draft sets the round's bucket); those cells are held for a moment, so reserved
            need += max(0, max_draft(buckets) - n_max)
        return chain, n_max, need

    def submit(self, req: GenerationRequest) -> Sequence:
        chain, n_max, need = self.validate(req)
        if len(self.queue) >= self.config.max_queue and not self.free_slots:
            raise QueueFullError(f"server busy: {len(self.active)} slots busy and {len(self.queue)} queued")
        seq = Sequence(req, chain, n_max, need)
        link(self.prompt_groups, seq)  # n > 1: shares the prompt's cells with its group's first (prompt_share.py)
        self.queue.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request (client went away); its slot frees within this call."""
        seq.cancelled = True
        if seq.state == SeqState.QUEUED:
            try:
                self.queue.remove(seq)
            except ValueError:
                pass
            seq.state = SeqState.FINISHED
            seq.finish_reason = "cancelled"
        elif not seq.finished:
            seq.finish_reason = "cancelled"
            self._finish(seq)

    def has_work(self) -> bool:
        """Whether step() has anything to do: sequences running or queued, or (overlapped rounds) the last
        round's events not yet returned, or its set-ups or merges not yet done, or rounds not yet learnt (the
        last one with overlapped rounds, else a batch short of LEARN_BATCH)."""
        return bool(self.active or self.queue or self._later or self._made or self._chain_later or self._learn_later)

    def _admit(self) -> None:
        """Queued sequences into free slots, in order; one that waits (for cells, or for another sequence's
        prefill of the prefix it will copy) lets those behind it pass, unless it waits for cells."""
        i = 0
        self.awaited = set()  # slots of prefilling sequences whose prefix queued ones wait to copy
        if self.config.queue_order == "cached" and 0 < len(self.free_slots) < len(self.queue):
            self._order_queue()
        while i < len(self.queue) and self.free_slots:
            seq = self.queue[i]
            prompt = seq.req.prompt_tokens
            every_row = self._every_row(seq)
            use = seq.req.cache_prompt and not every_row
            plan = fork_plan(seq, self.free_slots, self.prefix_cache.idle.slots, every_row, self.memory.keeps_prefix)
            if plan is None:
                plan = self.prefix_cache.plan(seq, self.free_slots, self.active, use,
                                              lambda q: self.shifter.enabled(q.req))
            if plan.slot is None:
                self.awaited.add(plan.wait)
                i += 1  # it copies the prefix of a sequence still prefilling it: a later round
                continue
            if not self.prefix_cache.admit(seq, plan, use, len(self.active)):
                break  # wait for cells to free up
            del self.queue[i]
            self.free_slots.remove(plan.slot)
            self.stats.shared_prompts += seq.fork_of is not None and plan.copy_from == seq.fork_of.slot
            seq.slot, seq.state, seq.t_admit = plan.slot, SeqState.PREFILL, time.perf_counter()
            self.active[plan.slot] = seq
            self.reserved += seq.reserve
            self._forget(plan.slot, seq.chain)  # what the policy learnt of the slot's last sequence
            # its speculators' set-up: while this round decodes where the overlap may take it (it drafts after
            # its prefill, and its first prompt rows are mirrored after the decode)
            self._speculators(seq.chain, functools.partial(self._begin, seq, plan.slot, prompt, plan.reuse))

    def _begin(self, seq: Sequence, slot: int, prompt: np.ndarray, reuse: int) -> None:
        """Its speculators start a sequence on `slot`, told of the `reuse` prompt tokens it starts with."""
        try:
            self.chain.begin(slot, seq.chain, prompt, seq.req.sampling.grammar)
        except Exception:  # a failing speculator degrades to plain decoding
            log.exception("speculator begin failed; sequence %s decodes without speculation", seq.id)
            seq.chain = ()
        if reuse:  # what a prefill of the reused prefix would have told the speculators
            self._mirror(seq, prompt[:reuse], 0)

    def _index_prompts(self, chunks: list[tuple[Sequence, int]]) -> None:
        """The speculators index the prompt rows this round prefills (Speculator.prefilling), as they are
        prefilled: a long prompt's indexing is spread over its prefill, a chunk a round, where all of it in the
        round that admits it would stall every other sequence's next token. With overlapped rounds, where the
        chain is model-free, it runs while this round decodes, as the set-up does."""
        for s, n in chunks:
            if s.chain:
                self._speculators(s.chain, functools.partial(self._prefilling, s, s.slot, s.n_prefilled + n),
                                  wait=False)

    def _prefilling(self, seq: Sequence, slot: int, n: int) -> None:
        try:
            self.chain.prefilling(slot, seq.chain, n)
        except Exception:  # a failing speculator degrades to plain decoding
            log.exception("speculator prefilling failed; sequence %s decodes without speculation", seq.id)
            seq.chain = ()

    def _end(self, slot: int, names: tuple[str, ...]) -> None:
        try:
            self.chain.end(slot, names)
        except Exception:
            log.exception("speculator end failed")

    def _speculators(self, names: tuple[str, ...], op: Callable[[], None], wait: bool = True) -> None:
        """Run a sequence's speculator set-up or merge (`op`) now, or, in overlapped rounds where `names` are
        all model-free, while the next round decodes. A model speculator decodes in a context of its own, kept
        on the round thread: its ops run now, after those still waiting (a slot's end before its next begin;
        `wait` False: an op of a sequence already begun, which need not wait for others' ops)."""
        if self.overlap and names and not any(self.chain.is_model(n) for n in names):
            self._chain_later.append(op)
            return
        if wait:
            self._run_chain_later()
        op()

    def _verdict(self, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray) -> None:
        """A sequence's verdict for its speculators and the policy (DraftPolicy.accept). The speculators hear it
        now, before they draft for the sequence again; with overlapped rounds the policy learns from it while
        the next round decodes (that round is planned on estimates one round older), in order with the
        `_forget`s of its slots."""
        if not self.overlap:
            self.policy.accept(prop, n_drafted, n_accepted, emitted)
            return
        self.policy.tell(prop, n_drafted, n_accepted, emitted)
        self._learn_later.append(functools.partial(_learn_verdict, self.policy, prop, n_drafted, n_accepted, emitted))

    def _forget(self, slot: int, names: tuple[str, ...]) -> None:
        """The policy forgets what it learnt of the sequence on `slot` (DraftPolicy.forget_sequence): now, or with
        overlapped rounds after the verdicts still waiting to be learnt, the slot's last one among them."""
        if self.overlap:
            self._learn_later.append(functools.partial(self.policy.forget_sequence, slot, names))
        else:
            self.policy.forget_sequence(slot, names)

    def _run_chain_later(self) -> None:
        ops, self._chain_later = self._chain_later, []
        for op in ops:
            op()

    def _order_queue(self) -> None:
        """More sequences wait than slots are free: the head of the queue in admission_order (fewest prompt
        rows left after what is cached first, those waited queue_max_wait_s first of all)."""
        head = [self.queue.popleft() for _ in range(min(ORDER_WINDOW, len(self.queue)))]
        now = time.perf_counter()
        rows = [len(s.req.prompt_tokens) - (self.prefix_cache.held(s.req.prompt_tokens, self.active)
                                            if s.req.cache_prompt and not self._every_row(s) else 0) for s in head]
        order = admission_order(rows, [now - s.t_submit for s in head], self.config.queue_max_wait_s)
        self.queue.extendleft(head[i] for i in reversed(order))

    def forget_prompt_cache(self, clear_kv: bool = True) -> None:
        """Drop every idle cache and host entry: the target's KV is gone (clear_kv False: a new target) or
        cannot be trusted."""
        self.prefix_cache.forget(clear_kv)

    def _prefill_seconds(self, n: int) -> float:
        """The cost model's price of prefilling n prompt tokens, in chunks of at most n_batch rows."""
        full, rest = divmod(n, self.config.n_batch)
        return full * self.cost.cost(self.config.n_batch, 0) + (self.cost.cost(rest, 0) if rest else 0.0)

    def _finish(self, seq: Sequence) -> None:
        seq.state = SeqState.FINISHED
        seq.t_finish = time.perf_counter()
        slot = seq.slot
        if self.active.get(slot) is seq:
            del self.active[slot]
            self.reserved -= seq.reserve
            self.free_slots.append(slot)
            # the KV cells hold the history up to n_past (a draft accepted past the end of generation is in the
            # cells but not in the history: cut; after a context shift, only the kept front): kept for a later
            # prompt, a failed state never
            self.target.release(slot, keep=self.prefix_cache.finished(seq))
            self._forget(slot, seq.chain)
            if seq.chain:
                self._speculators(seq.chain, functools.partial(self._end, slot, seq.chain))

    def use_policy(self, policy: DraftPolicy) -> None:
        """Draft with `policy` and its chain from the next round (between rounds only; the bench runs several
        chains on one engine, each with its own policy: DraftPolicy.for_chain)."""
        self._run_chain_later()  # set-ups and merges still waiting belong to the chain they were asked of
        self.policy, self.chain = policy, policy.chain

    def reconfigure_chain(self, new: ChainConfig) -> dict:
        """Swap the chain config for `new` while requests run (Chain.reconfigure: running sequences go on with
        rebuilt speculators); new requests get its chain, n_max and policy, queued ones keep their names.
        Raises ValueError, changing nothing, if `new` cannot be built. Call only between rounds, on the thread
        that runs step(): it ends and begins running sequences' speculators, which a round also calls."""
        old = self.config.chain
        self._run_chain_later()
        self._run_learn_later()  # verdicts of the speculators being rebuilt, into the estimates they replace
        change = self.chain.reconfigure(new, {s.slot: (s.chain, s.history_view()) for s in self.active.values()})
        self.policy.chain_changed(change)
        # a fresh instance gets another chance (one that failed and was not rebuilt stays disabled)
        self.disabled_speculators -= {*change.rebuilt, *change.built}
        self.config = self.config.model_copy(update={"chain": new})
        return {"chain": new.label, "rebuilt": change.rebuilt,
                "added": [n for n in new.speculators if n not in old.speculators],
                "resumed_sequences": change.resumed}

    # ---- one round -------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One round (module docstring); returns its events. With overlapped rounds (`overlap`), a round's
        events are made while the next round decodes, so step() returns the previous round's, and a step with
        no round to run returns what is left: a caller that steps while has_work() gets every event, in order."""
        clock = RoundClock()
        self._admit()
        if not self.active:
            self._make_later()
            return self._take_made()
        self.rounds_run += 1
        clock.lap("admit")
        if self.shared_cells is not None and not self.config.flash_attn_on:
            # every cell in use is computed for every token, masked or not: idle caches slow the running sequences
            cap = idle_budget(self.config.prompt_cache_slowdown, self.cost.cost(1, 0), self.cost.read_seconds)
            self.prefix_cache.evict_idle(lambda: self.prefix_cache.idle.idle_cells() <= cap)
        budget = self.target_budget()
        # slot order: llama.cpp packs consecutive sequence ids into one ubatch with a KV stream per slot (exact)
        by_slot = [self.active[k] for k in sorted(self.active)]
        decoding = [s for s in by_slot if s.state == SeqState.DECODING]
        prefilling = [s for s in by_slot if s.state == SeqState.PREFILL]
        self.stats.context_shifts += self.shifter.apply(decoding, self.chain)  # before any draft: none is pending
        # rows the target replays in front of decoding sequences' own (a restored recurrent state: rollback.py)
        replay = sum(s.replay_rows for s in decoding)
        chunks = self._prompt_chunks(prefilling, budget - len(decoding) - replay, bool(decoding))
        if chunks:
            clock.lap("plan")
            self._index_prompts(chunks)
            clock.lap("admit")
        n_prefill = sum(n for _, n in chunks)
        # KV cells a token of this round attends, on average: with one shared KV stream every slot's cells
        # (masked, but computed; idle caches too), with a stream per slot its own sequence's
        seqs = decoding or prefilling
        cells = (float(sum(s.n_past for s in by_slot) + self.prefix_cache.idle.idle_cells()) if self.shared_cells
                 else sum(s.n_past for s in seqs) / len(seqs) if seqs else 0.0)
        base_rows = len(decoding) + n_prefill + replay
        clock.lap("plan")
        width = self.config.tree_branches if self.memory.tree_seqs else 0
        proposals = self._draft(decoding, Room(budget - base_rows, base_rows, cells, tree_width=width,
                                               tree_seqs=self.memory.tree_seqs))
        clock.lap("draft")

        items = step_items(decoding, proposals, chunks, self._needs_hidden)
        quote = self._pad_to_tile(items) if self.memory.attention_tile and self.config.shape_buckets is None else None
        clock.lap("build")
        if self.overlap:
            out = self._overlapped(items)
        else:
            out = self.target.step(items)
        clock.split_target(None, out.decode_seconds, out.verify_seconds, out.instrument_seconds)
        if out.hidden is not None:  # before _mirror: process() pairs each commit with its rows
            try:
                self.chain.hidden(out.hidden)
            except Exception:
                log.exception("speculator hidden rows failed")
        self.prefix_cache.round_done(out.stashed, out.restored, out.host_kept)
        self.stats.target_seconds += out.decode_seconds
        self.stats.rollback.add(out.rollback)  # (None where a KV cache is trimmed)

        emit, failed = commit_round(self._verdict, decoding, proposals, chunks, items, out.results, self._mirror)
        clock.lap("accept")
        if self.overlap:  # tokens kept and sequences finished now; text and events while the next round decodes
            taken = [(s, *self._take(s, res), s.finished) for s, res in emit]
            fails = [self._fail(s, why) for s, why in failed]  # slot freed now, error event with the rest
            emitted = sum(len(t[1]) for t in taken)
            self._later += [functools.partial(_event, *t) for t in taken] + [functools.partial(_same, e) for e in fails]
            if not self.active and not self.queue:  # no next round to hide them behind
                self._make_later()
            clock.lap("emit")
            events = self._take_made()
        else:
            events = [self._emit(s, res) for s, res in emit]
            events += [self._fail(s, why) for s, why in failed]
            clock.lap("emit")
            if self.on_event:
                for e in events:
                    self.on_event(e)
        clock.lap("deliver")
        if not self.overlap:
            emitted = sum(len(e.tokens) for e in events)
        loaded = not n_prefill and len(decoding) == self.config.slots and not prefilling
        learn = (self.policy, clock, out, sum(len(it.tokens) for it in items), n_prefill, cells, len(decoding),
                 sum(p.rows for p in proposals), emitted, loaded,
                 self.policy.host_seconds(clock.work - clock.seconds.get("decode", 0.0)),
                 any(it.tile_pad for it in items), quote)
        if self.overlap:  # the round's stats and prices are learnt while the next round decodes
            self._learn_later.append(functools.partial(self._learn, *learn))
        elif len(self._learn_later) < LEARN_BATCH - 1:  # learnt with the rounds after it
            self._learn_later.append(functools.partial(self._learn, *learn))
            clock.lap("learn")
        else:
            self._run_learn_later()
            self._learn(*learn, lap=True)
        return events

    def _pad_to_tile(self, items: list[StepItem]) -> TileQuote | None:
        """Pad the round up to the attention kernel's tile where that is priced cheaper (tile_pads.py); returns
        the round's quote, which its decode time teaches `tile_fit`. A pad row's cell lives for one decode: it
        fits in its carrier's reservation or in the pool's unreserved cells."""
        def ends() -> dict[int, int]:  # asked only of a round tile_pad has not ruled out by its rows
            return {it.seq_id: it.pos0 + len(it.tokens) for it in items}

        def room() -> dict[int, int]:
            spare = self.prefix_cache.unreserved_cells()
            return {slot: min(self.active[slot].reserve - end + spare, self.n_ctx - end)
                    for slot, end in ends().items()}

        pad, quote = tile_pad(items, room, lambda: self.prefix_cache.written_cells(ends()),
                              self.memory.attention_tile, self.policy.cost, self.tile_fit)
        if pad is not None:
            slot, rows = pad
            for it in items:
                if it.seq_id == slot:
                    it.tile_pad = rows
            self.stats.tile_pads += 1
            self.stats.tile_pad_rows += rows
        return quote

    def _learn(self, policy: DraftPolicy, clock: RoundClock, out: StepOutput, n_rows: int, n_prefill: int,
               cells: float, n_decoding: int, draft_rows: int, emitted: int, loaded: bool, host: float,
               padded: bool = False, quote: TileQuote | None = None, lap: bool = False) -> None:
        """A round's timing into the price models of the policy that planned it (decode, host work, rollbacks),
        whatever policy plans the next round, and its stamps into the stats; `lap`: the round is this one, just
        ended, and the learning is its `learn` stage (an overlapped round learns in the next one's decode, others
        in batches of LEARN_BATCH rounds, each batch in the `learn` stage of its last round). A
        round padded to the attention tile teaches the price of its shape only, as a prefill round does: its
        decode ran another kernel than the few-row one the table and the attention cost price drafts at."""
        share = prefill_share(lambda n: policy.cost.cost(n, cells), n_rows, n_prefill)  # at the prices it ran at
        policy.observe(out.batch_sizes, out.decode_seconds, cells, n_prefill > 0 or padded, n_decoding, draft_rows,
                       host, emitted, out.rollback)
        if quote is not None and len(out.batch_sizes) == 1:
            self.tile_fit.observe(quote, out.decode_seconds)
        if lap:
            clock.lap("learn")  # this round's own stats folding below is the only work of a round left out
        self.stats.add_round(clock, share, emitted if loaded else None, n_decoding)

    def _prompt_chunks(self, prefilling: list[Sequence], room: int, beside: bool) -> list[tuple[Sequence, int]]:
        """(sequence, rows) of the round's prompt chunks in slot order: what the batch has room for after the
        decoding sequences' rows (prompt_chunks: short prompts and those others wait for first; `beside`:
        sequences decode this round, so the prefill budget applies)."""
        if not prefilling:
            return []
        first = tuple(i for i, s in enumerate(prefilling) if s.slot in self.awaited)
        oldest = min(range(len(prefilling)), key=lambda i: prefilling[i].t_admit or 0.0)
        rows = prompt_chunks([len(s.req.prompt_tokens) - s.n_prefilled for s in prefilling], room,
                             self.config.prefill_chunk, self.config.prefill_budget if beside else None, first,
                             oldest, PREFILL_FLOOR)
        return [(s, n) for s, n in zip(prefilling, rows) if n]

    def target_budget(self) -> int:  # the most rows one round's decode may carry
        return self.config.n_batch

    def _every_row(self, s: Sequence) -> bool:
        """Whether the sequence needs every prompt row decoded, which a reused prefix never gives: hidden-state
        speculators (their rows) and echo (the prompt's logprobs)."""
        return bool(self._needs_hidden(s) or s.req.sampling.prompt_logprobs)

    def _needs_hidden(self, s: Sequence) -> bool:
        """The target returns hidden rows only for sequences whose chain has a hidden-state speculator."""
        return bool(s.chain) and self.chain.needs_hidden(s.chain)

    def _mirror(self, s: Sequence, tokens: np.ndarray, pos: int) -> None:
        """Tell the sequence's speculators what the target committed (model speculators mirror it into
        their own KV cache and drop the rejected draft tail; model-free ones ignore it)."""
        if not s.chain:
            return
        try:
            self.chain.process(s.slot, s.chain, tokens, pos)
        except Exception:
            log.exception("speculator process failed")

    def _draft(self, decoding: list[Sequence], room: Room) -> list[Proposal]:
        if not any(s.chain for s in decoding):  # plain decoding: nothing to ask
            return [Proposal(s.slot, None) for s in decoding]
        buckets = self.config.shape_buckets
        reqs = draft_requests(decoding, self.disabled_speculators, self.n_ctx, buckets, self.memory.draft_cap,
                              self._tree_ok)
        if buckets is not None and room.base_rows == len(decoding):
            # a decode-only round is padded (target.verify_pads): drafts are priced by the shape the target runs
            room.rows = functools.partial(batch_rows, buckets=buckets, limit=self.config.n_batch)
        return self.policy.plan_round(reqs, room, self.disabled_speculators, self.stats)

    def _tree_ok(self, s: Sequence) -> bool:
        """Whether the sequence's draft may be a tree: the target has branch ids, the request allows it, no
        hidden-state speculator reads its committed rows (a tree's rows are not one path), and it replays no rows
        (a tree hangs off one committed row)."""
        return bool(self.memory.tree_seqs and s.req.tree and not s.replay_rows and not self._needs_hidden(s))

    def _fail(self, s: Sequence, why: str) -> Event:
        """End a sequence the target could not go on with (rollback.py): slot and state freed, error out."""
        log.error("request %s failed: %s", s.id, why)
        s.error, s.finish_reason = why, "error"
        self.stats.failed_sequences += 1
        self._finish(s)
        return Event(s, [], "", True, error=why)

    def _emit(self, s: Sequence, res: StepResult) -> Event:
        kept, text, lps, plp = self._take(s, res)
        return Event(s, kept, text if isinstance(text, str) else text(), s.finished, logprobs=lps,
                     prompt_logprobs=plp)

    def _take(self, s: Sequence, res: StepResult) -> tuple[list[int], str | Callable[[], str], object, object]:
        """A round's result into its sequence: the tokens it keeps (Sequence.take), the sequence finished where
        they end it. Returns (tokens kept, their text or a function that decodes it, their logprobs, the
        prompt's logprobs): what its event holds."""
        kept, text = s.take(res.tokens, res.margins, self.tok)
        self.stats.tokens_emitted += len(kept)
        lps, plp = s.take_logprobs(res.logprobs, len(kept))
        if s.finish_reason is not None:
            self._finish(s)
        return kept, text, lps, plp

    def use_overlap(self, decode_blocks: bool) -> None:
        """Overlap rounds from the next one (EngineConfig.overlap): the target must have `launch` and `collect`
        (TargetRunner). `decode_blocks`: its launch returns only when the decode is done (llama.cpp's CPU
        backend), so the overlapped work runs on a helper thread meanwhile (llama_decode releases the GIL);
        else (a GPU, whose launch returns once the graph is queued) on this thread after the launch."""
        self.overlap = True
        if decode_blocks and self._beside is None:
            self._beside = ThreadPoolExecutor(1, thread_name_prefix="specray-overlap")
        elif not decode_blocks and self._beside is not None:
            self._beside.shutdown(wait=True)
            self._beside = None

    def close(self) -> None:
        """Stop the overlap's helper thread, if there is one (the engine is going away: what was left for the
        next decode is dropped)."""
        if self._beside is not None:
            self._beside.shutdown(wait=True)
            self._beside = None

    def _overlapped(self, items: list[StepItem]) -> StepOutput:
        """The target call of an overlapped round: the decode started, the work left for it done meanwhile
        (_make_later), then the round's output. That work touches neither the target nor what the round's own
        bookkeeping reads, and it is done before this returns."""
        def beside() -> None:
            t0 = time.perf_counter()
            self._make_later()
            self.stats.overlapped_seconds += time.perf_counter() - t0

        self.stats.overlapped_rounds += 1
        if self._beside is None:  # the launch returns at once: the work goes between it and the wait
            self.target.launch(items)
            try:
                beside()
            finally:
                out = self.target.collect()  # the launched round is read whatever happened meanwhile
            return out
        helper = self._beside.submit(beside)
        try:
            self.target.launch(items)
            return self.target.collect()
        finally:
            helper.result()

    def _make_later(self) -> None:
        """The work left for the next decode: speculators' set-ups and merges, then the last round's events
        made (their text decoded now) and delivered (on_event), in order (step() returns them), then the last
        round's learning: the policy's from its verdicts and its stats and prices (the next round was planned
        on estimates and prices one round older)."""
        self._run_chain_later()
        later, self._later = self._later, []
        for make in later:
            e = make()
            self._made.append(e)
            if self.on_event:
                self.on_event(e)
        if later and self.on_delivered:
            self.on_delivered()
        self._run_learn_later()

    def _run_learn_later(self) -> None:
        """The learning left for later, now: verdicts and forgotten slots (overlapped rounds), the rounds' stats
        and prices."""
        ops, self._learn_later = self._learn_later, []
        for op in ops:
            op()

    def _take_made(self) -> list[Event]:
        made, self._made = self._made, []
        return made

    def run(self, reqs: list[GenerationRequest]) -> list[Sequence]:  # all of them, to the end
        seqs = [self.submit(r) for r in reqs]
        while self.has_work():
            self.step()
        return seqs
