"""Where a new sequence's prompt starts from: the longest cached prefix wherever it lives.

A prompt's prefix may already be in the target's KV cells in several places: an idle slot's cache (a finished
sequence's cells, engine/prompt_cache.py), a running sequence's committed cells, or a prefix saved to host
memory (engine/host_tier.py). `plan_prefix` picks, for the sequence at the head of the queue, the free slot it
takes and how its first cells get there:

- the slot's own idle cache, cut back to the shared prefix (no copy);
- a copy of another slot's first cells (`seq_cp`: in one KV pool the cells are shared, not copied; with a KV
  stream per slot the stream is copied whole and cut back);
- a restore of a host-memory entry, where its price (measured) is below the prefill it saves;
- or a wait: a sequence still prefilling a long shared prefix (agents' common system prompt) will hold it in a
  round or two, and copying it then saves more than prefilling it alongside.

Its rules, in order: the sequence takes a slot whose cache the prompt continues (the next turn of its
conversation: the shared prefix is at least half of what it holds), else an empty slot, else the least
recently used idle one (its cache is let go: saved to host memory first by the caller). Into that slot goes
the longest prefix held anywhere: the slot's own cells, else a copy of the slot holding the most, else a host
entry holding more still where restoring it is cheaper than prefilling the difference; unless a sequence still
prefilling will soon hold at least `min_wait` tokens more. At most len(prompt) - 1 tokens are reused: the last
prompt token must be decoded for the first token's logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .prompt_cache import Cached, common_prefix


@dataclass(frozen=True)
class PrefixPlan:
    """`slot`: the free slot taken (None with `wait`); `reuse`: prompt tokens the sequence starts with; `copy_from`:
    the slot whose first `reuse` cells it copies; `restore`: the host-tier key it restores; `share`: with a
    restore in one KV pool, (slot, n): that slot holds the first n of those tokens, and the sequence shares its
    cells instead of keeping the restored copy of them; `wait`: the slot of a prefilling sequence it waits for
    (it stays queued this round)."""

    slot: int | None
    reuse: int = 0
    copy_from: int | None = None
    restore: int | None = None
    wait: int | None = None
    share: tuple[int, int] | None = None


@dataclass(frozen=True)
class Holders:
    """What the engine holds that a prompt may start from. `idle`: idle caches (in free slots); `live`: running
    sequences' committed cells that may be copied (slot -> tokens); `pending`: sequences still prefilling
    (slot -> their whole prompt); `host`: host-tier entries' best match, a function of (prompt, limit) ->
    (key, shared tokens)."""

    idle: dict[int, Cached]
    live: dict[int, np.ndarray]
    pending: dict[int, np.ndarray]
    host: Callable[[np.ndarray, int], tuple[int | None, int]] | None = None


def destination(free: list[int], idle: dict[int, Cached]) -> int:
    """The free slot a sequence takes when no cache there is its own: an empty one, else the least recently used.

    >>> destination([0, 1, 2], {0: Cached(np.array([1]), 5)}), destination([0, 1], {0: Cached(np.array([1]), 5),
    ...                                                                            1: Cached(np.array([2]), 3)})
    (2, 1)
    """
    empty = [s for s in free if s not in idle]
    if empty:
        return empty[-1]
    return min(free, key=lambda s: idle[s].last_used)


def plan_prefix(prompt: np.ndarray, free: list[int], holders: Holders, can_copy: bool,
                worth_restore: Callable[[int, int], bool] = lambda key, gain: True,
                min_wait: int = 32, pooled: bool = False) -> PrefixPlan:
    """The plan for a new sequence's prompt (see the module docstring). `can_copy`: cells may be copied between
    slots (the target keeps prefixes and the request allows it). `worth_restore(key, gain)`: whether restoring
    host entry `key` beats prefilling `gain` more tokens. `min_wait`: the fewest tokens a wait must save.
    `pooled`: one KV pool for all slots, where a restore shares the prefix another slot holds (`share`)
    instead of keeping a second copy of it.

    >>> idle = {0: Cached(np.array([1, 2, 3, 4, 5]), 5), 1: Cached(np.array([1, 2, 9, 9, 9, 9, 9]), 3)}
    >>> h = Holders(idle, live={}, pending={})
    >>> plan_prefix(np.array([1, 2, 3, 4, 5, 6]), [0, 1, 2], h, True)   # the next turn of slot 0's conversation
    PrefixPlan(slot=0, reuse=5, copy_from=None, restore=None, wait=None, share=None)
    >>> plan_prefix(np.array([1, 2, 7]), [0, 1, 2], h, True)            # a new one: the empty slot, its prefix copied
    PrefixPlan(slot=2, reuse=2, copy_from=0, restore=None, wait=None, share=None)
    >>> plan_prefix(np.array([1, 2, 7]), [0, 1, 2], h, False)           # no copies: the empty slot, nothing reused
    PrefixPlan(slot=2, reuse=0, copy_from=None, restore=None, wait=None, share=None)
    >>> live = Holders(idle, live={3: np.arange(100, 400)}, pending={3: np.arange(100, 900)})
    >>> plan_prefix(np.arange(100, 800), [2], live, True)               # slot 3 will hold 700: wait for it
    PrefixPlan(slot=None, reuse=0, copy_from=None, restore=None, wait=3, share=None)
    >>> host = Holders(idle, live={3: np.array([1, 2, 3, 9])}, pending={}, host=lambda p, limit: (7, 7))
    >>> plan_prefix(np.arange(1, 9), [0, 1, 2], host, True, pooled=True)  # host entry 7 holds 7; slot 3 holds 3
    PrefixPlan(slot=0, reuse=7, copy_from=None, restore=7, wait=None, share=(3, 3))
    """
    limit = max(0, len(prompt) - 1)
    idle = holders.idle
    shared = {s: min(common_prefix(c.tokens, prompt), limit) for s, c in idle.items() if s in free}
    continuing = [s for s, n in shared.items() if n > 0 and 2 * n >= len(idle[s].tokens)]
    # the longest prefix in the KV cells: idle caches and running sequences
    sources = dict(shared)
    if can_copy:
        sources.update({s: min(common_prefix(t, prompt), limit) for s, t in holders.live.items()})
    best_src = max(sources, key=lambda s: (sources[s], s in shared), default=None)
    in_kv = sources[best_src] if best_src is not None else 0
    if continuing:  # its own conversation's slot; other holders may still hold more of it
        dst = max(continuing, key=lambda s: (shared[s], idle[s].last_used))
    else:
        dst = destination(free, idle)
    plan = PrefixPlan(dst, shared.get(dst, 0))
    if can_copy and best_src is not None and in_kv > plan.reuse:
        plan = PrefixPlan(dst, in_kv, copy_from=best_src)
    if can_copy and holders.host is not None:
        key, n = holders.host(prompt, limit)
        if key is not None and n > plan.reuse and worth_restore(key, n - plan.reuse):
            # the restore clears dst first: its own cells cannot be the ones shared
            held = {s: min(k, n) for s, k in sources.items() if s != dst and k > 0}
            src = max(held, key=lambda s: held[s], default=None) if pooled else None
            plan = PrefixPlan(dst, n, restore=key, share=None if src is None else (src, held[src]))
    if can_copy:
        soon = {s: min(common_prefix(t, prompt), limit) for s, t in holders.pending.items()}
        waits = [s for s, n in soon.items() if n - plan.reuse >= min_wait]
        if waits:
            return PrefixPlan(None, wait=max(waits, key=lambda s: soon[s]))
    return plan
