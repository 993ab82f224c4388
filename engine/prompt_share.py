"""n > 1: sequences of one request share its prompt's KV cells (llama.cpp's seq_cp), as llama-server's
parallel sequences do.

Requests submitted with the same `share_prompt` key and the same prompt form a group: the first one
prefills the prompt; each other one waits in the queue until then, takes a free slot, copies the first
one's cells (`TargetRunner.start(copy_from=...)`) and keeps all but the last prompt token, which it
decodes itself: that row samples its own first token, with its own seed. Where the copy cannot be made
(the first one is gone or failed, the target's memory cannot be cut back to a prefix, a request needs every
prompt row: hidden-state speculators, echo) it prefills on its own; the output is the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .prefix_plan import PrefixPlan, destination
from .request import SeqState

if TYPE_CHECKING:
    from .request import Sequence

__all__ = ["link", "fork_plan"]


def link(groups: dict[str, "Sequence"], seq: "Sequence") -> None:
    """Make `seq` copy the prompt of its group's first live sequence (or become that one).

    >>> from specray.engine.request import GenerationRequest, Sequence
    >>> g = {}
    >>> a, b = (Sequence(GenerationRequest(np.arange(5, dtype=np.int32), share_prompt="r1"), (), 0, 8) for _ in "ab")
    >>> link(g, a); link(g, b)
    >>> b.fork_of is a, a.fork_of
    (True, None)
    """
    key = seq.req.share_prompt
    if key is None:
        return
    src = groups.get(key)
    if src is not None and not src.finished and np.array_equal(src.req.prompt_tokens, seq.req.prompt_tokens):
        seq.fork_of = src
    else:
        groups[key] = seq
    for k in [k for k, s in groups.items() if s.finished]:  # forget finished groups
        del groups[k]


def fork_plan(seq: "Sequence", free: list[int], idle: dict, needs_every_row: bool,
              keeps_prefix: bool) -> PrefixPlan | None:
    """The plan of a sequence of an n > 1 group: copy its group's first sequence's prompt cells into a free slot
    (an empty one, else the least recently used: `idle` are the idle caches), or wait while that one still
    prefills; None where it prefills on its own (no group, the first is gone or failed, the copy cannot be
    made)."""
    prompt = seq.req.prompt_tokens
    src = seq.fork_of
    if src is None or not keeps_prefix or needs_every_row or len(prompt) <= 1:
        return None
    if src.state in (SeqState.QUEUED, SeqState.PREFILL) and not src.finished:
        return PrefixPlan(None, wait=src.slot)
    if src.state == SeqState.DECODING and src.error is None and src.n_past >= len(prompt):
        return PrefixPlan(destination(free, idle), len(prompt) - 1, copy_from=src.slot)
    return None
