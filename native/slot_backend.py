"""What the companion's per-slot contexts share: the draft model (draft_backend.py) and the MTP / EAGLE-3
heads (hidden.py) each hold one sequence per slot, remove KV by slot, and price their draft steps with
decode costs measured as a draft step runs: one row per sequence.

A recurrent or hybrid companion model (a Mamba or LFM2 draft model) cannot drop a sequence's tail: its
state has absorbed every draft token. The speculator saves a checkpoint where its committed tokens end,
before it decodes draft tokens (`checkpoint`); a later `seq_rm` past it comes back to that checkpoint and
reports where it came back to, and the speculator decodes the rest again with its next catch-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from specray.engine.cost import paired_decode_costs

from .checkpoints import SeqCheckpoints
from .context import Context
from .model import Model

log = logging.getLogger("specray.companion")


def top_token_probs(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Argmax of each row and its softmax probability (over the whole vocabulary)."""
    top = logits.argmax(axis=1)
    m = logits[np.arange(len(top)), top]
    z = np.exp(logits - m[:, None]).sum(axis=1)
    return top.astype(np.int32), (1.0 / z).astype(np.float64)


def top_two_token_probs(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """top_token_probs, and each row's runner-up (the second most likely token) with its probability: one
    more pass over the exponentials the probabilities need anyway.

    >>> t, p, r, q = top_two_token_probs(np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32)))
    >>> t.tolist(), r.tolist(), np.round(p, 3).tolist(), np.round(q, 3).tolist()
    ([1, 0], [2, 2], [0.6, 0.5], [0.3, 0.3])
    """
    rows = np.arange(len(logits))
    top = logits.argmax(axis=1)
    e = np.exp(logits - logits[rows, top][:, None])  # the top token's is 1, every other's at most 1
    z = e.sum(axis=1)
    e[rows, top] = -1.0
    second = e.argmax(axis=1)
    return (top.astype(np.int32), (1.0 / z).astype(np.float64), second.astype(np.int32),
            (e[rows, second] / z).astype(np.float64))


class SlotBackend:
    """A llama context with one sequence per slot (not thread-safe; the speculator's caller serialises)."""

    def __init__(self, model: Model, ctx: Context) -> None:
        self.model = model
        self.ctx = ctx
        self.n_batch = ctx.n_batch
        self._costs: dict[int, float] = {}
        self.n_decodes = 0
        # recurrent or hybrid model: one saved state per slot, and the cells it stands for
        self.checkpoints = SeqCheckpoints(ctx) if model.memory_kind != "attention" else None
        self._saved_at: dict[int, int] = {}
        self.restores = 0  # seq_rm calls that came back to a checkpoint
        self.clears = 0  # seq_rm calls that had to clear the whole sequence (no checkpoint to come back to)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        """Context shift of seq_id's cells (Context.shift_seq); False where this model cannot (recurrent: the
        speculator resets the sequence and catches up instead)."""
        return self.checkpoints is None and self.ctx.shift_seq(seq_id, n_keep, n_discard)

    def seq_rm(self, seq_id: int, p0: int) -> int:
        """Drop seq_id's cells from p0 on. Returns the cells kept: p0, or where a recurrent state cannot be cut
        there, the position of its checkpoint at or before p0 (restored), else 0 (cleared). The caller decodes
        again what lies between."""
        if p0 > 0 and self.ctx.seq_rm(seq_id, p0, -1):
            return p0
        at = self._saved_at.pop(seq_id, -1)
        if 0 < at <= p0:
            try:
                self.checkpoints.restore(seq_id)
                if self.ctx.seq_rm(seq_id, at, -1):  # a hybrid's attention cells past the checkpoint
                    self._saved_at[seq_id] = at  # still the state there: it may serve again
                    self.restores += 1
                    return at
            except Exception:
                log.exception("restoring the saved state of companion sequence %s failed; clearing it", seq_id)
        if p0 > 0:
            self.clears += 1
        self.ctx.clear_seq(seq_id)
        return 0

    def checkpoint(self, seq_id: int, pos: int) -> None:
        """Save seq_id's state, which holds its first `pos` cells, for seq_rm to come back to (recurrent and
        hybrid models only: a KV cache is cut anywhere)."""
        if self.checkpoints is None:
            return
        self._saved_at.pop(seq_id, None)
        self.checkpoints.save(seq_id)
        self._saved_at[seq_id] = pos

    def pos_max(self, seq_id: int) -> int:
        return self.ctx.seq_pos_max(seq_id)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def decode_costs(self) -> dict[int, float]:
        return dict(self._costs)

    def use_costs(self, costs: dict[int, float]) -> None:
        """Take another copy's measured step costs (ms by batch size, in seconds) instead of measuring: the
        bench's engine copies of one model skip calibration."""
        self._costs = dict(costs)

    def _measure_step_costs(
        self, sizes: tuple[int, ...], reps: int, prefix: int,
        prime: Callable[[list[int]], None], clear: Callable[[], None],
        add_row: Callable[[int, int, int], None], run: Callable[[], None],
    ) -> dict[int, float]:
        """Seconds per decode of n rows: every row extends its own sequence after a `prefix`-long
        context, as in a draft step (more rows than slots extend the sequences further).
        prime(seqs) fills the prefix; add_row(seq, i, pos) adds the row of prefix item i at pos.

        Timed in pairs with a 1-row step (specray.engine.cost.paired_decode_costs), as the target's
        table is: a slow spell of the host must not become the shape."""
        sizes = tuple(n for n in sizes if n <= self.n_batch)
        n_seq = max(1, min(self.ctx.n_seq_max, max(sizes, default=1)))
        seqs = list(range(n_seq))
        for s in seqs:
            self.ctx.clear_seq(s)
        prime(seqs)

        def timed(n: int) -> float:
            clear()
            for j in range(n):
                add_row(seqs[j % n_seq], j % prefix, prefix + j // n_seq)
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            for s in seqs:
                if not self.ctx.seq_rm(s, prefix, -1):  # a recurrent state: cleared and primed again
                    self.ctx.clear_seq(s)
                    prime([s])
            return dt

        for n in sizes:  # warm up the buffers for every size
            timed(n)
        out = paired_decode_costs(sizes, reps, timed)
        for s in seqs:
            self.ctx.clear_seq(s)
        self._costs = out
        return out
