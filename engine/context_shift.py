"""Context shift: a sequence that reaches its context discards old cells and goes on (opt-in, as llama-server).

llama-server (tools/server/server-context.cpp), when a slot's n_past + 1 would reach its context and
`--context-shift` is on: keep the first `n_keep` tokens (+ BOS; -1: the whole prompt), discard `n_discard`
after them (0: half of what lies past the kept ones), `llama_memory_seq_rm` those cells and
`llama_memory_seq_add` the later ones back by n_discard; generation goes on at n_past - n_discard.

Here the same happens at the top of a round, before any draft is made, so:

- the shift falls on the same token in every run of a request: a verify never crosses the context (drafts
  are cut to the room left, `draft_requests`), so n_past reaches n_ctx - 1 exactly, with speculation or
  without, and greedy output is the same either way;
- no draft is pending for the sequence when it shifts (drafts of this round are made on the shifted
  sequence); the target applies the shift before it decodes the round's rows (`StepItem.shift`), so the
  distributed mode needs no extra actor call;
- what holds *positions* follows: the target's KV (seq_rm + seq_add), each model speculator's cache
  (`Speculator.shift`: the draft model shifts its own KV the same way, or resets and catches up; MTP /
  EAGLE-3 heads stop drafting for the sequence, their hidden rows of the discarded past are gone), and the
  prompt cache, which may later reuse only the cells before the discarded ones (`Sequence.kv_prefix`);
- what holds *tokens* keeps the whole history: the n-gram and suffix speculators read it (their drafts are
  verified, so more history only means more matches). Model speculators get the shifted token list
  (`Sequence.kv_history`), whose index is again the KV position.

Recurrent and hybrid targets cannot shift positions (llama_memory_can_shift): refused at build and per request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .request import GenerationRequest, Sequence

if TYPE_CHECKING:
    from .chain import Chain

log = logging.getLogger("specray.context_shift")


def shift_plan(n_past: int, n_keep: int, n_discard: int | None, n_prompt: int, bos: int = 0) -> tuple[int, int]:
    """(cells kept at the front, cells discarded after them) of a sequence with n_past cells that reached its
    context, as llama-server decides them: n_keep tokens (-1: the whole prompt) plus the BOS token where the
    sequence starts with one, then n_discard (None or 0: half of what lies past the kept ones). At least one
    cell is discarded and the kept ones are clamped so that one can be.

    >>> shift_plan(255, 0, None, 40, bos=1)    # keep BOS; discard (255 - 1) // 2 = 127; go on at 128
    (1, 127)
    >>> shift_plan(255, -1, None, 40)          # keep the prompt: (255 - 40) // 2 = 107
    (40, 107)
    >>> shift_plan(255, 10, 64, 40, bos=1)     # as asked
    (11, 64)
    >>> shift_plan(255, 10, 500, 40)           # no more than lies past the kept ones
    (10, 245)
    >>> shift_plan(255, -1, None, 255)         # a prompt that fills the context: one cell goes
    (254, 1)
    """
    keep = n_prompt if n_keep < 0 else n_keep + bos
    keep = max(0, min(keep, n_past - 1))
    left = n_past - keep
    discard = n_discard if n_discard else left // 2
    return keep, max(1, min(discard, left))


class ContextShifter:
    """The scheduler's context-shift stage: which sequences may shift, and shifting them at the top of a round."""

    def __init__(self, config, memory, n_ctx: int, bos: int | None = None) -> None:
        """config: the EngineConfig (context_shift, n_keep, n_discard defaults); memory: the target's
        TargetMemory (can_shift); n_ctx: cells one sequence may use; bos: the vocabulary's BOS token (None: none).
        ValueError if shifting is on by default and the target cannot shift."""
        self.default = bool(config.context_shift)
        self.n_keep, self.n_discard = config.n_keep, config.n_discard
        self.can_shift = memory.can_shift
        self.n_ctx = n_ctx
        self.bos = bos
        self.shifts = 0  # shifts applied so far (RoundStats.context_shifts mirrors it)
        if self.default and not self.can_shift:
            raise ValueError(f"context_shift: this target's memory ({memory.kind}) cannot shift positions "
                             "(llama_memory_can_shift is false, e.g. a recurrent or hybrid model): turn it off")

    def enabled(self, req: GenerationRequest) -> bool:
        """Whether `req` shifts (its own setting, else the engine's). ValueError where the target cannot."""
        on = self.default if req.context_shift is None else bool(req.context_shift)
        if on and not self.can_shift:
            raise ValueError("context_shift: this target's memory cannot shift positions (a recurrent or hybrid "
                             "model); send the request without it")
        return on

    def plan(self, seq: Sequence) -> tuple[int, int] | None:
        """(keep, discard) if `seq` reached its context this round and shifts, else None."""
        if seq.n_past + 1 < self.n_ctx or not self.enabled(seq.req):
            return None
        req = seq.req
        prompt = req.prompt_tokens
        bos = int(self.bos is not None and len(prompt) > 0 and int(prompt[0]) == self.bos)
        n_keep = self.n_keep if req.n_keep is None else req.n_keep
        n_discard = self.n_discard if req.n_discard is None else req.n_discard
        if seq.shift_keep is not None:  # the kept front never moves: later shifts discard right after it
            n_keep, bos = seq.shift_keep, 0
        return shift_plan(seq.n_past, n_keep, n_discard, len(prompt), bos)

    def apply(self, decoding: list[Sequence], chain: "Chain") -> int:
        """Shift every decoding sequence that reached its context (the target follows with the sequence's next
        StepItem; the speculators now). Returns how many shifted."""
        n = 0
        for s in decoding:
            plan = self.plan(s)
            if plan is None:
                continue
            keep, discard = plan
            s.shift(keep, discard)
            shift_speculators(chain, s.slot, s.chain, keep, discard)
            n += 1
        self.shifts += n
        return n


def shift_speculators(chain: "Chain", seq_id: int, names: tuple[str, ...], keep: int, discard: int) -> None:
    """Tell the sequence's speculators its cells [keep, keep + discard) are gone and the later ones moved back.
    A speculator that fails here is ended for the sequence: it would draft from a cache that no longer lines up
    (output stays lossless either way; it only loses its drafts)."""
    for name in names:
        spec = chain.instances.get(name)
        if spec is None:
            continue
        try:
            spec.shift(seq_id, keep, discard)
        except Exception:
            log.exception("speculator %s failed to shift sequence %s; it ends for this sequence", name, seq_id)
            try:
                spec.end(seq_id)
            except Exception:
                log.exception("ending speculator %s on sequence %s failed", name, seq_id)
