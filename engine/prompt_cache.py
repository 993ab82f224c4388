"""The prompt cache: finished sequences' KV stays in their slot, and a new request reuses the longest common prefix.

A slot that finished a sequence keeps the tokens whose KV cells it still holds
(the prompt and the generated tokens up to the last one decoded). A new request
goes to the free slot whose cached tokens share the longest prefix with its
prompt; the target then drops only the cells past that prefix and prefills the
rest of the prompt, and the response reports the reused tokens as
`usage.prompt_tokens_details.cached_tokens` (as OpenAI does). Multi-turn chat is
the case it is for: turn n's prompt is turn n-1's prompt + answer + a new
message, so all but the new message is already in the slot.

The scheduler owns one `PromptCache` (engine/scheduler.py) and asks it which
slot to use (`choose`, a pure function underneath) and which idle caches to
evict when KV cells run short or cost too much (`evict`, `idle_budget`). The KV itself lives in the target;
this object only remembers what each slot holds. It must be cleared whenever
the target's KV is lost (a target actor restarted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays.

    >>> common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])), common_prefix(np.array([1]), np.array([1, 2]))
    (2, 1)
    """
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass
class Cached:
    """What one idle slot holds: `tokens` (KV cells 0..len-1), and when it was last used (a tick)."""

    tokens: np.ndarray
    last_used: int


def choose_slot(free: list[int], cached: dict[int, Cached], prompt: np.ndarray) -> tuple[int, int]:
    """(slot, tokens to reuse) for a new prompt among the free slots.

    1. A slot whose cache the prompt mostly continues (common prefix >= half of what it holds: the next turn of
       its conversation) wins; the longest prefix first.
    2. Else an empty slot, so no other conversation's cache is thrown away for a short shared prefix (a system
       prompt).
    3. Else the slot with the longest common prefix, the least recently used among equals: its cache is evicted.
    At most len(prompt) - 1 tokens are reused: the last prompt token must be decoded for the first token's logits.

    >>> c = {0: Cached(np.array([1, 2, 3, 4, 5]), 5), 1: Cached(np.array([1, 2, 9, 9, 9, 9, 9]), 3)}
    >>> choose_slot([0, 1, 2], c, np.array([1, 2, 3, 4, 5, 6]))  # the next turn of slot 0's conversation
    (0, 5)
    >>> choose_slot([0, 1, 2], c, np.array([1, 2, 7]))              # a new conversation: the empty slot
    (2, 0)
    >>> choose_slot([0, 1], c, np.array([1, 2, 7]))                 # no empty slot: longest prefix, then LRU
    (1, 2)
    >>> choose_slot([0], c, np.array([1, 2, 3, 4, 5]))          # all of it cached: the last token decodes again
    (0, 4)
    """
    if not free:
        raise ValueError("no free slot")
    limit = max(0, len(prompt) - 1)
    lcp = {s: min(common_prefix(cached[s].tokens, prompt), limit) if s in cached else 0 for s in free}
    continuing = [s for s in free if s in cached and lcp[s] > 0 and 2 * lcp[s] >= len(cached[s].tokens)]
    if continuing:
        best = max(continuing, key=lambda s: (lcp[s], cached[s].last_used))
        return best, lcp[best]
    empty = [s for s in free if s not in cached]
    if empty:
        return empty[-1], 0
    best = max(free, key=lambda s: (lcp[s], -cached[s].last_used))
    return best, lcp[best]


def idle_budget(slowdown: float, one_row_seconds: float, per_cell_seconds: float) -> int:
    """Idle cached KV cells allowed in one KV pool for all slots with flash attention off, where llama.cpp
    computes every cell in use for each token, masked or not: cells whose price (per_cell_seconds per one-row
    decode, calibrated: the cost model's read_seconds) stays within `slowdown` of a one-row decode; no limit (a huge
    number) when the price is unknown (no calibration).

    >>> idle_budget(0.1, 0.0058, 2.1e-6)       # a 5.8 ms one-row decode, 2.1 us more per idle cell
    276
    >>> idle_budget(0.1, 0.007, 0.0) > 10**9
    True
    """
    if per_cell_seconds <= 0:
        return 1 << 62
    return int(slowdown * one_row_seconds / per_cell_seconds)


class PromptCache:
    """The scheduler's record of idle slots' KV (see the module docstring). Off: remembers nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.slots: dict[int, Cached] = {}
        self._tick = 0
        self.hits = 0  # requests that reused at least one cached token
        self.lookups = 0  # requests that were allowed to use the cache
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to the cache
        self.evicted = 0  # idle caches dropped to make room for other sequences' KV

    def keep(self, slot: int, tokens: np.ndarray) -> bool:
        """A sequence finished in `slot` with `tokens` in its KV cells: keep them. False when off (or nothing to
        keep): the caller frees the cells."""
        if not self.enabled or len(tokens) == 0:
            return False
        self._tick += 1
        self.slots[slot] = Cached(np.array(tokens, dtype=np.int32), self._tick)
        return True

    def pick(self, free: list[int], prompt: np.ndarray, use: bool = True) -> tuple[int, int]:
        """The slot for a new sequence and the prompt tokens already in its KV (choose_slot); changes nothing.
        With `use` False (the cache is off, or the request said cache_prompt: false) nothing is reused, and an
        empty slot, else the least recently used one, is taken."""
        use = self.enabled and use
        # an empty prompt matches nothing: an empty slot, else the least recently used one
        return choose_slot(free, self.slots, prompt if use else prompt[:0])

    def claim(self, slot: int, reuse: int, used: bool) -> None:
        """`slot` now belongs to a sequence that reuses `reuse` of its cached tokens: forget the record
        (`used`: the request was allowed to use the cache, for the hit rate)."""
        self.lookups += int(used and self.enabled)
        if reuse:
            self.hits += 1
            self.reused_tokens += reuse
        self.slots.pop(slot, None)

    def idle_cells(self, but: int | None = None) -> int:
        """KV cells the idle caches hold (all slots, or all but `but`)."""
        return sum(len(c.tokens) for s, c in self.slots.items() if s != but)

    def evict(self, cells: int, release: Callable[[int], None], but: int | None = None) -> None:
        """Drop least recently used idle caches (never `but`'s) until they hold at most `cells` (-1: all of them),
        calling release(slot) for each, which frees its KV cells."""
        for s in sorted((s for s in self.slots if s != but), key=lambda s: self.slots[s].last_used):
            if self.idle_cells(but) <= cells:
                break
            del self.slots[s]
            self.evicted += cells >= 0  # a forced clear (target lost) is not an eviction
            release(s)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "lookups": self.lookups, "hits": self.hits,
                "reused_tokens": self.reused_tokens, "evicted": self.evicted,
                "idle_slots": len(self.slots), "idle_cells": self.idle_cells()}
