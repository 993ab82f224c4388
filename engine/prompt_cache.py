"""The prompt cache: finished sequences' KV stays in their slot, and a new request reuses the longest common prefix.

A slot that finished a sequence keeps the tokens whose KV cells it still holds
(the prompt and the generated tokens up to the last one decoded). A new request
starts from the longest prefix any slot holds, idle or running, or the host
tier holds (engine/prefix_plan.py says where and how); the target keeps or
copies the cells of that prefix, prefills the rest of the prompt, and the
response reports the reused tokens as
`usage.prompt_tokens_details.cached_tokens` (as OpenAI does). Multi-turn chat is
the case it is for: turn n's prompt is turn n-1's prompt + answer + a new
message, so all but the new message is already in the slot.

The scheduler owns one `PromptCache` (engine/scheduler.py): the idle caches,
which it plans from and evicts when KV cells run short or cost too much
(`evict`, `idle_budget`). The KV itself lives in the target;
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
        self.copies = 0  # requests that started from another slot's cells or the host tier

    def keep(self, slot: int, tokens: np.ndarray) -> bool:
        """A sequence finished in `slot` with `tokens` in its KV cells: keep them. False when off (or nothing to
        keep): the caller frees the cells."""
        if not self.enabled or len(tokens) == 0:
            return False
        self._tick += 1
        self.slots[slot] = Cached(np.array(tokens, dtype=np.int32), self._tick)
        return True

    def claim(self, slot: int, reuse: int, used: bool, copied: bool = False) -> None:
        """`slot` now belongs to a sequence that starts with `reuse` cached tokens (`copied`: from another slot
        or the host tier): forget the slot's record (`used`: the request was allowed to use the cache, for the
        hit rate)."""
        self.lookups += int(used and self.enabled)
        if reuse:
            self.hits += 1
            self.reused_tokens += reuse
            self.copies += copied
        self.slots.pop(slot, None)

    def idle_cells(self, but: int | None = None) -> int:
        """KV cells the idle caches hold (all slots, or all but `but`)."""
        return sum(len(c.tokens) for s, c in self.slots.items() if s != but)

    def evict(self, enough: Callable[[], bool], let_go: Callable[[int, Cached], None],
              but: tuple[int, ...] = (), counted: bool = True) -> None:
        """Drop least recently used idle caches (never those of the slots in `but`) until `enough()`, calling
        let_go(slot, cache) for each, which frees its KV cells (`counted` False: a forced clear, not an eviction)."""
        for s in sorted((s for s in self.slots if s not in but), key=lambda s: self.slots[s].last_used):
            if enough():
                break
            cached = self.slots.pop(s)
            self.evicted += counted
            let_go(s, cached)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "lookups": self.lookups, "hits": self.hits,
                "reused_tokens": self.reused_tokens, "evicted": self.evicted, "copies": self.copies,
                "idle_slots": len(self.slots), "idle_cells": self.idle_cells()}
