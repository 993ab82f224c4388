"""Finished sequences' indexes, kept for a request that continues one (a conversation's next turn).

An agent's or a chat client's next request sends the whole conversation again: the last request's prompt, its
answer and a few new messages. A model-free speculator that indexes each request's own history (`suffix`'s
per-request trie, `ngram_cache`'s context table) would index those thousands of tokens again, on the round
thread, before the request's first draft. Kept here when its sequence ends, an index is taken by the next
request whose prompt starts with every token it indexed; the speculator then indexes only the tokens after them,
which leaves it the state a fresh start on that prompt builds.

Bounded by count and by the tokens indexed, the oldest leaving first (`on_drop` is told, for a speculator that
owes a kept state somewhere else, as `ngram_cache` owes its counts to the dynamic table).

>>> kept = KeptStates(max_states=2, max_tokens=100)
>>> kept.put(np.array([1, 2, 3], np.int32), "A"); kept.put(np.array([1, 2], np.int32), "B")
>>> kept.take(np.array([1, 2, 3, 4], np.int32))   # the longest one the prompt continues
'A'
>>> kept.take(np.array([1, 2, 3, 4], np.int32))   # A is taken: B is left, and the prompt continues it too
'B'
>>> kept.take(np.array([1, 2], np.int32)) is None, len(kept)
(True, 0)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np


class KeptStates:
    def __init__(self, max_states: int, max_tokens: int, on_drop: Callable[[Any], None] | None = None) -> None:
        self.max_states = max_states
        self.max_tokens = max_tokens
        self._on_drop = on_drop
        self._kept: OrderedDict[int, tuple[np.ndarray, Any]] = OrderedDict()  # oldest first
        self._next = 0
        self.tokens = 0  # tokens the kept states indexed
        self.taken = 0  # states a later request started from
        self.tokens_saved = 0  # tokens those requests did not index again

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, tokens: np.ndarray, state: Any) -> None:
        """Keep `state`, the index of exactly `tokens` (copied), dropping the oldest beyond the bounds (a state
        past max_tokens on its own is not kept: on_drop gets it at once)."""
        if self.max_states <= 0 or len(tokens) == 0 or len(tokens) > self.max_tokens:
            self._drop(state)
            return
        self._kept[self._next] = (np.array(tokens, dtype=np.int32), state)
        self._next += 1
        self.tokens += len(tokens)
        while len(self._kept) > self.max_states or self.tokens > self.max_tokens:
            _, (toks, old) = self._kept.popitem(last=False)
            self.tokens -= len(toks)
            self._drop(old)

    def take(self, prompt: np.ndarray) -> Any | None:
        """The kept state whose tokens `prompt` starts with, the longest such (removed: the caller's sequence
        extends it from here), or None."""
        n = len(prompt)
        best, best_len = None, 0
        for key, (toks, _) in self._kept.items():
            m = len(toks)
            # the first and the last token first: most kept states belong to other conversations
            if best_len < m <= n and toks[0] == prompt[0] and toks[m - 1] == prompt[m - 1] \
                    and np.array_equal(toks, prompt[:m]):
                best, best_len = key, m
        if best is None:
            return None
        _, state = self._kept.pop(best)
        self.tokens -= best_len
        self.taken += 1
        self.tokens_saved += best_len
        return state

    def drain(self) -> list[Any]:
        """Every kept state, oldest first, removed (not given to on_drop)."""
        out = [state for _, state in self._kept.values()]
        self._kept.clear()
        self.tokens = 0
        return out

    def _drop(self, state: Any) -> None:
        if self._on_drop is not None:
            self._on_drop(state)
