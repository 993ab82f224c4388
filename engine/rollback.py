"""How the target undoes a rejected draft, by what its memory can do.

An attention KV cache drops any suffix of a sequence (seq_rm): mode "trim".
A recurrent layer (Mamba, RWKV, LFM2's short convolution; hybrids mix them
with attention) holds one state per sequence that has already absorbed every
row of a verify, rejected drafts included; llama.cpp's seq_rm refuses to cut
it. Two ways back (llama.cpp PR #19493, ik_llama.cpp's spec checkpoints):

- "snapshots": llama.cpp keeps the recurrent state after each of the last
  n_rs_seq tokens of a sequence (the context's n_rs_seq), and seq_rm of up to
  that many trailing tokens rolls back to one of them. Free per draft (every
  decode writes the snapshots), but only some architectures have it, drafts
  are capped at n_rs_seq tokens, and only with at most MAX_SNAPSHOT_SLOTS
  sequences: the vendored llama.cpp moves a sequence's recurrent cell when a
  later ubatch of the same decode needs its cells contiguous, without moving
  the snapshots, so a rollback then restores another sequence's state, with no
  error (seen with 3 and 4 sequences whose slots had been reused;
  tests/integration/test_rollback_snapshots.py keeps watching it).
- "checkpoint": the drafted sequences' recurrent states are saved before the
  verify; after a partial rejection the state is restored, a hybrid's
  attention KV trimmed back to the verify's first row, and the committed rows
  (the verify's context tokens plus the accepted drafts) are replayed in
  front of that sequence's rows in the next round's batch, with the other
  sequences' work. A draft costs a save, and a rejection a restore plus the
  replayed rows (rollback_price.py prices both).
- "off": the target decodes without drafts.

"auto" runs checkpoint: it puts no cap on the draft's length, it is right with any number of slots, and
every recurrent architecture has it. Snapshots keep the saved states where the model runs (no copy to the
host), which is why they remain an option for a large recurrent state on a GPU.

Any refusal (seq_rm false, a save or restore failing) fails that sequence
(StepResult.error): nothing ever decodes on a state holding rejected tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

ROLLBACK_CHOICES = ("auto", "snapshots", "checkpoint", "off")

#: the most sequences (slots) llama.cpp's rollback snapshots stay right with (module docstring)
MAX_SNAPSHOT_SLOTS = 2


def wants_snapshots(memory_kind: str, requested: str, slots: int, drafts: bool) -> bool:
    """Whether to ask the context for rollback snapshots (n_rs_seq): a recurrent or hybrid target that drafts,
    with few enough slots, where the mode may use them. Every decode writes them, drafted or not.

    >>> wants_snapshots("hybrid", "snapshots", 1, True), wants_snapshots("hybrid", "snapshots", 4, True)
    (True, False)
    >>> wants_snapshots("hybrid", "auto", 1, True), wants_snapshots("hybrid", "snapshots", 1, drafts=False)
    (False, False)
    """
    return memory_kind != "attention" and requested == "snapshots" and drafts and slots <= MAX_SNAPSHOT_SLOTS


def rollback_mode(memory_kind: str, requested: str, n_rs_seq: int, slots: int = 1) -> str:
    """The mode a target runs: requested (EngineConfig.rollback) against what its memory and context allow.

    >>> rollback_mode("attention", "checkpoint", 0)   # a KV cache drops any suffix
    'trim'
    >>> rollback_mode("hybrid", "snapshots", 8), rollback_mode("hybrid", "auto", 0), rollback_mode("recurrent", "off", 0)
    ('snapshots', 'checkpoint', 'off')
    >>> rollback_mode("recurrent", "snapshots", 0)
    Traceback (most recent call last):
    ...
    ValueError: rollback 'snapshots' needs llama.cpp's recurrent-state snapshots (n_rs_seq), which this model's architecture does not have: use 'checkpoint' or 'auto'
    >>> rollback_mode("hybrid", "snapshots", 0, slots=4)
    Traceback (most recent call last):
    ...
    ValueError: rollback 'snapshots' is right with at most 2 slots (llama.cpp moves a sequence's recurrent cell without its snapshots when more share a decode): use 'checkpoint' or 'auto' with 4 slots
    """
    if memory_kind == "attention":
        return "trim"
    if requested not in ROLLBACK_CHOICES:
        raise ValueError(f"rollback must be one of {', '.join(ROLLBACK_CHOICES)}, got {requested!r}")
    if requested == "snapshots" and slots > MAX_SNAPSHOT_SLOTS:
        raise ValueError(f"rollback 'snapshots' is right with at most {MAX_SNAPSHOT_SLOTS} slots (llama.cpp moves a "
                         "sequence's recurrent cell without its snapshots when more share a decode): use "
                         f"'checkpoint' or 'auto' with {slots} slots")
    if requested == "snapshots" and n_rs_seq <= 0:
        raise ValueError("rollback 'snapshots' needs llama.cpp's recurrent-state snapshots (n_rs_seq), which this "
                         "model's architecture does not have: use 'checkpoint' or 'auto'")
    return "checkpoint" if requested == "auto" else requested


@dataclass(frozen=True)
class TargetMemory:
    """What the router needs to know of the target's memory: its kind, the rollback mode, the snapshots."""

    kind: str = "attention"  # attention | recurrent | hybrid (native.model.memory_kind)
    rollback: str = "trim"  # trim | snapshots | checkpoint | off
    n_rs_seq: int = 0  # recurrent-state snapshots per sequence (snapshots mode)
    # positions can be shifted (llama_memory_can_shift: context shift); False for recurrent and hybrid memory
    can_shift: bool = True
    # sequence ids beyond the slots for draft trees' branches (engine/draft_tree.py); 0: drafts stay linear
    tree_seqs: int = 0
    # rows from which the target's attention runs a tiled kernel (native Context.attention_tile_rows): a round
    # of fewer rows may be padded up to it (engine/tile_pads.py); 0: no such kernel
    attention_tile: int = 0

    @property
    def draft_cap(self) -> int | None:
        """The most draft tokens a sequence may send (None: no cap beyond the chain's)."""
        return 0 if self.rollback == "off" else self.n_rs_seq if self.rollback == "snapshots" else None

    @property
    def keeps_prefix(self) -> bool:
        """Whether a sequence's memory can be cut back to a prefix (the prompt cache reuses one)."""
        return self.kind == "attention"

    def to_dict(self) -> dict:
        return asdict(self)


class RollbackError(RuntimeError):
    """A sequence's state could not be brought back to what the target committed: it cannot go on."""


class RollbackContext(Protocol):  # what specray.native.Context provides
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...


class Checkpoints(Protocol):  # specray.native.checkpoints.SeqCheckpoints
    def save(self, seq_id: int) -> int: ...
    def restore(self, seq_id: int) -> None: ...
    def drop(self, seq_id: int) -> None: ...


@dataclass
class RollbackStats:
    verifies: int = 0  # verifies that carried drafts
    rollbacks: int = 0  # of them, rejected in part: the state was rolled back
    saves: int = 0
    save_seconds: float = 0.0
    state_bytes: int = 0  # size of the last saved state
    restores: int = 0
    restore_seconds: float = 0.0
    replay_rows: int = 0  # committed rows decoded again after a restore
    replay_seconds: float = 0.0  # their share of the decodes that carried them (by rows)
    failures: int = 0  # sequences failed because their state could not be rolled back

    def to_dict(self) -> dict:
        return asdict(self)

    def add(self, other: "RollbackStats | None") -> None:
        """Count another round's work in (state_bytes: the latest)."""
        if other is None:
            return
        for k, v in asdict(other).items():
            setattr(self, k, v if k == "state_bytes" else getattr(self, k) + v)

    def minus(self, before: "RollbackStats") -> "RollbackStats":
        """This round's part: these counters less an earlier copy of them."""
        a, b = asdict(self), asdict(before)
        return RollbackStats(**{k: (a[k] if k == "state_bytes" else a[k] - b[k]) for k in a})


@dataclass
class StateRollback:
    """The target runner's side: saves before a verify, undoes rejected rows after it, replays what a restore
    took back. One per target context."""

    mode: str = "trim"
    checkpoints: Checkpoints | None = None  # checkpoint mode
    stats: RollbackStats = field(default_factory=RollbackStats)
    _replay: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # seq -> (pos0, tokens)

    def __post_init__(self) -> None:
        if self.mode == "checkpoint" and self.checkpoints is None:
            raise ValueError("checkpoint rollback needs the context's checkpoint buffers")

    def forget(self, seq_id: int) -> None:
        """The slot starts or ends a sequence: no replay, no checkpoint."""
        self._replay.pop(seq_id, None)
        if self.checkpoints is not None:
            self.checkpoints.drop(seq_id)

    def pending_rows(self, seq_id: int) -> int:
        """Rows seq_id's next verify replays in front of its own."""
        r = self._replay.get(seq_id)
        return 0 if r is None else len(r[1])

    def prepare(self, items: list, make_item) -> tuple[list, dict[int, str]]:
        """Before the decode: each item with a pending replay gets it in front of its rows (make_item(item,
        tokens, pos0, n_replay) builds the longer item); in checkpoint mode each item carrying drafts has its
        state saved. Returns (the items to decode, {seq_id: error} for sequences that cannot go on)."""
        failed: dict[int, str] = {}
        if not self._replay and self.mode != "checkpoint":
            return items, failed
        out = []
        for it in items:
            r = self._replay.pop(it.seq_id, None)
            if r is not None:
                pos0, toks = r
                if pos0 + len(toks) != it.pos0:
                    failed[it.seq_id] = (f"sequence {it.seq_id}: a replay of {len(toks)} rows from position {pos0} "
                                         f"does not end where its next rows start ({it.pos0})")
                    continue
                it = make_item(it, np.concatenate([toks, it.tokens]), pos0, len(toks))
            if self.mode == "checkpoint" and it.n_draft > 0:
                t0 = time.perf_counter()
                try:
                    self.stats.state_bytes = self.checkpoints.save(it.seq_id)
                except Exception as e:
                    failed[it.seq_id] = f"sequence {it.seq_id}: saving its recurrent state failed: {e}"
                    continue
                self.stats.saves += 1
                self.stats.save_seconds += time.perf_counter() - t0
            out.append(it)
        self.stats.failures += len(failed)
        return out, failed

    def undo(self, ctx: RollbackContext, it: Any, n_acc: int, pad: int) -> str | None:
        """After verifying `it` (its drafts, then `pad` pad rows): take the rejected rows back out of the
        sequence's memory. Returns an error for a sequence that cannot go on, else None."""
        k = it.n_draft
        if k > 0:
            self.stats.verifies += 1
        if n_acc >= k and not pad:
            if self.mode == "checkpoint" and k > 0:
                self.checkpoints.drop(it.seq_id)
            return None
        if k > n_acc:
            self.stats.rollbacks += 1
        keep = it.pos0 + it.n_commit + n_acc  # the first position to drop
        if self.mode != "checkpoint":
            if ctx.seq_rm(it.seq_id, keep, -1):
                return None
            self.stats.failures += 1
            return (f"sequence {it.seq_id}: the target refused to drop its {k - n_acc + pad} rejected rows from "
                    f"position {keep} (llama_memory_seq_rm returned false; rollback mode {self.mode!r}): its "
                    "state would hold tokens the target never committed")
        t0 = time.perf_counter()
        try:
            self.checkpoints.restore(it.seq_id)
        except Exception as e:
            self.stats.failures += 1
            return f"sequence {it.seq_id}: restoring its recurrent state failed: {e}"
        # the recurrent part is back before pos0; a hybrid's attention cells from pos0 on go too
        if not ctx.seq_rm(it.seq_id, it.pos0, -1):
            self.stats.failures += 1
            return (f"sequence {it.seq_id}: after restoring its recurrent state, the target refused to drop its "
                    f"cells from position {it.pos0} (llama_memory_seq_rm returned false)")
        self.stats.restores += 1
        self.stats.restore_seconds += time.perf_counter() - t0
        self._replay[it.seq_id] = (it.pos0, np.array(it.tokens[:keep - it.pos0], dtype=np.int32))
        return None
