"""The engine's one prefix cache: idle slots' caches, running sequences' cells and a host-memory tier.

Agents and chat apps send the same long system prompt in every request and come back turn after turn with
the conversation so far. The scheduler admits each sequence through this object:

- `plan` finds where its prompt starts from (engine/prefix_plan.py: its own slot's cache, another slot's
  cells, idle or running, a host-memory entry, or a wait for a sequence still prefilling the shared prefix);
- `admit` makes room (least recently used idle caches go, saved to host memory first where that pays), tells
  the target (TargetRunner.start with `copy_from` or `restore`) and accounts the cells;
- `finished` keeps a finished sequence's cells as its slot's idle cache;
- `round_done` takes the sizes of the round's host saves and keeps the host tier within its budget.

Cells shared through `seq_cp` are counted once (engine/cell_ledger.py), in one KV pool; with a KV stream per
slot (exact mode) a copy is a copy of the stream and every slot has its own cells, so nothing is pooled.
A sequence whose context may shift never shares cells in one KV pool: a shift moves the positions of every
sequence that sees a cell. Recurrent and hybrid targets cannot cut a state back to a prefix: no prefix is
reused there (`enabled` is False).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .cell_ledger import CellLedger
from .host_tier import HostTier
from .prefix_plan import Holders, PrefixPlan, destination, plan_prefix
from .prompt_cache import Cached, PromptCache, common_prefix
from .request import SeqState

if TYPE_CHECKING:
    from .request import Sequence

#: the fewest tokens an idle cache must hold to be saved to host memory (less is cheaper to prefill again)
MIN_STASH_TOKENS = 64
#: the fewest prompt tokens a wait for a prefilling sequence must save (fewer: prefill them alongside)
MIN_WAIT_TOKENS = 32


class PrefixTarget(Protocol):  # what the scheduler's target provides for the prefix cache
    def start(self, seq_id: int, params, prompt: np.ndarray, n_keep: int = 0, copy_from: int | None = None,
              restore: int | None = None, share: tuple[int, int] | None = None) -> None: ...
    def release(self, seq_id: int, keep: int = 0) -> None: ...
    def stash(self, seq_id: int, key: int) -> None: ...
    def drop_stash(self, keys: list[int]) -> None: ...


class PrefixCache:
    """See the module docstring. `shared_cells`: the one KV pool's size (None: a stream per slot);
    `host_bytes`: the host tier's budget (0: off); `prefill_seconds(n)`: the price of prefilling n tokens."""

    def __init__(self, target: PrefixTarget, enabled: bool, shared_cells: int | None, host_bytes: int,
                 prefill_seconds: Callable[[int], float]) -> None:
        self.target = target
        self.idle = PromptCache(enabled)
        self.shared_cells = shared_cells
        self.ledger = CellLedger()
        self.host = HostTier(host_bytes if enabled else 0)
        self.prefill_seconds = prefill_seconds
        self.copies_from_running = 0  # admissions that copied a running sequence's cells
        self.waits = 0  # rounds a queued sequence waited for another's prefill of their shared prefix
        self.cell_waits = 0  # rounds a free slot stayed empty: its sequence waited for KV cells (one pool)
        self.shared_restores = 0  # restores that share a prefix another slot holds instead of a copy of it

    @property
    def enabled(self) -> bool:
        return self.idle.enabled

    # ---- admission -------------------------------------------------------------------------------
    def plan(self, seq: "Sequence", free: list[int], active: dict[int, "Sequence"], use: bool,
             shifts: Callable[["Sequence"], bool]) -> PrefixPlan:
        """Where `seq`'s prompt starts from (prefix_plan.plan_prefix). `use`: it may reuse cached cells at all
        (the cache is on, the request allows it, it needs no prompt row of its own); `shifts(seq)`: its context
        may shift."""
        prompt = seq.req.prompt_tokens
        if not (use and self.enabled):
            return PrefixPlan(destination(free, self.idle.slots))
        pooled = self.shared_cells is not None
        can_copy = not (pooled and shifts(seq))
        live = {s: q.kv_prefix() for s, q in active.items()
                if q.error is None and not q.finished and not (pooled and shifts(q))}
        pending = {s: q.req.prompt_tokens for s, q in active.items()
                   if q.state == SeqState.PREFILL and s in live and q.n_prefilled < len(q.req.prompt_tokens)}
        host = self.host.best if self.host.enabled and self.host.entries else None
        plan = plan_prefix(prompt, free, Holders(self.idle.slots, live, pending, host), can_copy,
                           self._worth_restore, MIN_WAIT_TOKENS, pooled)
        if not can_copy and plan.reuse and self._shares(plan.slot):
            # its own cache's cells are shared with other sequences: a shift would move theirs too
            plan = PrefixPlan(plan.slot)
        if plan.wait is not None:
            self.waits += 1
        return plan

    def held(self, prompt: np.ndarray, active: dict[int, "Sequence"]) -> int:
        """The longest prefix of `prompt` held anywhere: idle caches, running sequences' committed cells, the
        host tier (at most len(prompt) - 1, as `plan` reuses). An estimate for the admission order; which
        holder a sequence starts from, and whether it waits, is `plan`'s choice at its admission."""
        if not self.enabled or len(prompt) < 2:
            return 0
        n = max((common_prefix(c.tokens, prompt) for c in self.idle.slots.values()), default=0)
        for q in active.values():
            if q.error is None and not q.finished:
                n = max(n, common_prefix(q.kv_prefix(), prompt))
        if self.host.enabled and self.host.entries:
            n = max(n, self.host.best(prompt)[1])
        return min(n, len(prompt) - 1)

    def admit(self, seq: "Sequence", plan: PrefixPlan, used: bool, running: int) -> bool:
        """Take `plan`'s slot for `seq`: make room for its cells (False, nothing changed but idle caches let go,
        where there is none while `running` sequences hold cells: it waits), then the target starts it. Sets
        seq.cached_tokens (and n_prefilled, n_past) to the tokens it starts with."""
        slot, reuse = plan.slot, plan.reuse
        if self.shared_cells is not None:
            keep = tuple(s for s in (slot, plan.copy_from, plan.share and plan.share[0]) if s is not None)
            if not self._make_room(seq, plan, keep) and running:
                self.cell_waits += 1
                return False
        cached = self.idle.slots.get(slot)
        if cached is not None and len(cached.tokens) - (0 if copied_in(plan) else reuse) >= MIN_STASH_TOKENS:
            self._save(slot, cached.tokens)  # cells of it are about to go: to host memory first, where that pays
        copied = copied_in(plan)
        # an n > 1 sibling's copy of its group's prompt is not a cache hit (Scheduler stats: shared_prompts)
        sibling = seq.fork_of is not None and plan.copy_from == seq.fork_of.slot
        self.idle.claim(slot, 0 if sibling else reuse, used, copied)
        self.target.start(slot, seq.req.sampling, seq.req.prompt_tokens, reuse, plan.copy_from, plan.restore,
                          plan.share)
        if plan.copy_from is not None and plan.copy_from not in self.idle.slots:
            self.copies_from_running += 1
        self.shared_restores += plan.share is not None
        _apply(self.ledger, plan, seq.reserve)
        seq.n_prefilled = seq.n_past = seq.cached_tokens = reuse
        return True

    def finished(self, seq: "Sequence") -> int:
        """`seq` ended in its slot: keep its cells as the slot's idle cache (a failed state never); returns the
        cells kept (the target keeps that many, frees the rest)."""
        tokens = seq.kv_prefix()
        keep = seq.error is None and self.idle.keep(seq.slot, tokens)
        kept = len(tokens) if keep else 0
        self.ledger.clip(seq.slot, kept)
        return kept

    def evict_idle(self, enough: Callable[[], bool], but: tuple[int, ...] = ()) -> None:
        """Let idle caches go, least recently used first, until `enough()` (saved to host memory first where
        that pays)."""
        self.idle.evict(enough, self._let_go, but)

    def round_done(self, stashed: dict[int, int], restored: list[tuple[int, float, bool]], kept: int = 0) -> None:
        """What the target's host tier did since the last round (StepOutput.stashed: key -> bytes saved;
        StepOutput.restored: (key, seconds, made); StepOutput.host_kept: bytes of dropped saves' buffers it keeps
        for its next saves): record it; keep to the budget."""
        self.host.kept_bytes = kept
        for key, seconds, ok in restored:
            self.host.restored(key, seconds, ok)
        for key, nbytes in stashed.items():
            if nbytes:
                self.host.resize(key, nbytes)
            else:
                self.host.remove(key)
        over = self.host.over_budget()
        for key in over:
            self.host.remove(key)
        if over:
            self.target.drop_stash(over)

    def forget(self, clear_kv: bool = True) -> None:
        """The target's KV (and its host saves) are gone or cannot be trusted: forget every idle cache and host
        entry (`clear_kv`: tell the target to free them; False: a new target, which holds none)."""
        def drop(slot: int, cached: Cached) -> None:
            self.ledger.clear(slot)
            if clear_kv:
                self.target.release(slot)
        self.idle.evict(lambda: False, drop, counted=False)
        keys = self.host.clear()
        if clear_kv and keys:
            self.target.drop_stash(keys)

    # ---- inside -----------------------------------------------------------------------------------
    def _worth_restore(self, key: int, gain: int) -> bool:
        return self.host.restore_price(key) < self.prefill_seconds(gain)

    def _shares(self, slot: int) -> bool:
        """Whether another slot holds cells `slot` holds."""
        return self.ledger.cells(without=(slot,)) + self.ledger.held(slot) > self.ledger.cells()

    def _make_room(self, seq: "Sequence", plan: PrefixPlan, keep: tuple[int, ...]) -> bool:
        """Let idle caches go (never those of `keep`), least recently used first, until the pool has room for
        `seq` under `plan`; whether it has. None go where even all of them would not make room."""
        def fits(ledger: CellLedger) -> bool:
            trial = ledger.copy()
            _apply(trial, plan, seq.reserve)
            return trial.cells() <= self.shared_cells

        gone = tuple(s for s in self.idle.slots if s not in keep)
        if not fits(self.ledger.without(gone)):
            return False
        self.evict_idle(lambda: fits(self.ledger), but=keep)
        return True

    def _let_go(self, slot: int, cached: Cached) -> None:
        """An idle cache is evicted: saved to host memory where that pays, then its cells freed."""
        self._save(slot, cached.tokens)
        self.ledger.clear(slot)
        self.target.release(slot)

    def _save(self, slot: int, tokens: np.ndarray) -> None:
        """Save `slot`'s cells to the host tier (applied by the target before anything else touches the slot),
        unless they are short, or already held there."""
        if not self.host.enabled or len(tokens) < MIN_STASH_TOKENS or self.host.covers(tokens):
            return
        key = self.host.new_key()
        gone = self.host.add(key, tokens, self.host.bytes_per_token() * len(tokens))
        if gone:
            self.target.drop_stash(gone)
        self.target.stash(slot, key)

    def unreserved_cells(self) -> int:
        """Cells of the one KV pool that no sequence reserves and no idle cache holds (0 without one pool)."""
        return max(0, self.shared_cells - self.ledger.cells()) if self.shared_cells is not None else 0

    def written_cells(self, ends: dict[int, int]) -> int | None:
        """KV cells the slots of `ends` (slot -> the position its rows of a round end at) hold, shared ones
        counted once (CellLedger.written); None without one KV pool."""
        return self.ledger.written(ends) if self.shared_cells is not None else None

    def stats(self) -> dict:
        return self.idle.stats() | {"copies_from_running": self.copies_from_running, "waits": self.waits,
                                    "cell_waits": self.cell_waits, "shared_restores": self.shared_restores,
                                    "pool_cells": self.ledger.cells() if self.shared_cells is not None else None,
                                    "host": self.host.to_dict()}


def copied_in(plan: PrefixPlan) -> bool:
    """Whether the plan's first cells come from elsewhere (another slot, host memory), not the slot's own."""
    return plan.copy_from is not None or plan.restore is not None


def _apply(ledger: CellLedger, plan: PrefixPlan, reserve: int) -> None:
    if plan.copy_from is not None:
        ledger.share(plan.slot, plan.copy_from, plan.reuse)
        ledger.own(plan.slot, plan.reuse, reserve)
    elif plan.restore is not None and plan.share is not None:  # the restored cells past a shared prefix
        src, n = plan.share
        ledger.share(plan.slot, src, n)
        ledger.own(plan.slot, n, reserve)
    elif plan.restore is not None:
        ledger.own(plan.slot, 0, reserve)
    else:
        ledger.own(plan.slot, plan.reuse, reserve)
