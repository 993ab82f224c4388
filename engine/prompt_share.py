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

from .request import SeqState

if TYPE_CHECKING:
    from .prompt_cache import PromptCache
    from .request import Sequence

__all__ = ["link", "admit_plan"]


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


def admit_plan(seq: "Sequence", cache: "PromptCache", free: list[int], needs_every_row: bool,
               keeps_prefix: bool) -> tuple[int, int, bool, int | None] | None:
    """(slot, prompt tokens already there, whether the prompt cache was asked, slot to copy from) for the
    sequence at the head of the queue; None: it waits for the sequence whose prompt it copies."""
    prompt = seq.req.prompt_tokens
    src = seq.fork_of
    if src is not None and keeps_prefix and not needs_every_row and len(prompt) > 1:
        if src.state in (SeqState.QUEUED, SeqState.PREFILL) and not src.finished:
            return None
        if src.state == SeqState.DECODING and src.error is None and src.n_past >= len(prompt):
            slot, _ = cache.pick(free, prompt, False)
            return slot, len(prompt) - 1, False, src.slot
    use = seq.req.cache_prompt and not needs_every_row
    slot, reuse = cache.pick(free, prompt, use)
    return slot, reuse, use, None
