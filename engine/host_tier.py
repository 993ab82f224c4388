"""The prompt cache's host-memory tier: evicted prefixes saved to RAM and restored when a later prompt shares them.

llama-server's `--cache-ram` does this for its slots; so does this tier, for the whole engine. When the
scheduler lets go of an idle cache (its cells are needed, or its slot goes to another conversation), the
target saves that sequence's cells to host memory (`llama_state_seq_get_data`) under a key; a later request
whose prompt shares a long prefix with it has them written back into its slot (`llama_state_seq_set_data`) and
prefills only the rest. The bytes stay with the target (TargetRunner's stash, in the target actor when it is
one); this index, in the scheduler, knows what each entry holds and decides.

The entries' tokens are indexed in a radix tree (engine/radix_index.py): the longest match, the entries a new
save supersedes and whether one already covers a prefix are each one walk, however many entries there are.

It is bounded: entries are dropped least recently used first beyond `budget_bytes` (which also holds the
buffers the target keeps of dropped entries to save the next ones into, `kept_bytes`), and an entry whose
tokens are a prefix of a newer one's is dropped as the newer one is saved (a conversation's next turn holds
all of its last one). Restoring is priced against prefilling: the measured seconds per byte of restores so far
(a first guess of memcpy speed until one is measured) against the cost model's price of the rows it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .radix_index import RadixIndex

#: seconds per byte a restore is priced at before one has been timed (a host memcpy of a few GB/s)
FIRST_GUESS_SECONDS_PER_BYTE = 1.0 / 2e9


@dataclass
class HostEntry:
    tokens: np.ndarray  # the positions 0..len-1 its saved cells hold
    nbytes: int
    last_used: int


@dataclass
class HostTierStats:
    saves: int = 0  # prefixes saved to host memory
    restores: int = 0  # prefixes written back into a slot
    failed_restores: int = 0  # restores the target refused (no room in its KV cells): the prompt was prefilled
    evictions: int = 0  # entries dropped for the byte budget or superseded by a longer one
    restore_seconds: float = 0.0
    restored_bytes: int = 0


class HostTier:
    """The index of prefixes held in host memory (see the module docstring). `budget_bytes` 0: off.

    >>> tier = HostTier(budget_bytes=100)
    >>> tier.add(tier.new_key(), np.array([1, 2, 3]), 60)        # saved under key 0
    []
    >>> tier.best(np.array([1, 2, 3, 4]))                        # (key, tokens it shares with the prompt)
    (0, 3)
    >>> tier.add(tier.new_key(), np.array([1, 2, 3, 4, 5]), 70)  # a longer one supersedes key 0
    [0]
    >>> tier.add(tier.new_key(), np.array([7, 8]), 50), tier.over_budget()  # 120 bytes: the oldest must go
    ([], [1])
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: dict[int, HostEntry] = {}
        self.index = RadixIndex()  # the entries' tokens, by key
        self.bytes = 0
        self.kept_bytes = 0  # dropped entries' buffers the target keeps for its next saves (counted in the budget)
        self.stats = HostTierStats()
        self._tick = 0
        self._next_key = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def new_key(self) -> int:
        """A key for the next save (the target stores the bytes under it)."""
        self._next_key += 1
        return self._next_key - 1

    def add(self, key: int, tokens: np.ndarray, nbytes: int) -> list[int]:
        """Record the prefix the target saved under `key` (`nbytes`); returns the keys of the entries it
        supersedes (their tokens a prefix of `tokens`), dropped here: the target drops their bytes. Call
        `over_budget` next and drop what it names."""
        self._tick += 1
        tokens = np.array(tokens, dtype=np.int32)
        gone = [k for k in self.index.prefixes_of(tokens) if k != key]
        for k in gone:
            self.remove(k)
        self.entries[key] = HostEntry(tokens, int(nbytes), self._tick)
        self.index.insert(key, tokens)
        self.bytes += int(nbytes)
        self.stats.saves += 1
        return gone

    def covers(self, tokens: np.ndarray) -> bool:
        """Whether an entry already holds all of `tokens` (saving them again would add nothing)."""
        return self.index.covers(tokens)

    def over_budget(self) -> list[int]:
        """Keys to drop, least recently used first, until the entries and the kept buffers fit the budget."""
        out, total = [], self.bytes + self.kept_bytes
        if total <= self.budget_bytes:  # asked every round: most find the tier within its budget, with nothing to sort
            return out
        for k in sorted(self.entries, key=lambda k: self.entries[k].last_used):
            if total <= self.budget_bytes:
                break
            out.append(k)
            total -= self.entries[k].nbytes
        return out

    def resize(self, key: int, nbytes: int) -> None:
        """The target reports what a save under `key` really holds."""
        e = self.entries.get(key)
        if e is not None:
            self.bytes += int(nbytes) - e.nbytes
            e.nbytes = int(nbytes)

    def bytes_per_token(self) -> int:
        """Bytes a saved token takes, from the entries held (0 before any: the first save is recorded at 0
        bytes until the target reports its size)."""
        n = sum(len(e.tokens) for e in self.entries.values())
        return self.bytes // n if n else 0

    def remove(self, key: int) -> None:
        e = self.entries.pop(key, None)
        self.index.remove(key)
        if e is not None:
            self.bytes -= e.nbytes
            self.stats.evictions += 1

    def best(self, prompt: np.ndarray, limit: int | None = None) -> tuple[int | None, int]:
        """(key, tokens shared with `prompt`, at most `limit`) of the entry sharing the longest prefix, of those
        the one holding the fewest tokens (the cheapest restore); (None, 0) when none shares any."""
        return self.index.longest(prompt if limit is None else prompt[:limit])

    def restore_price(self, key: int) -> float:
        """Seconds a restore of entry `key` is expected to take (the measured rate, else the first guess)."""
        s = self.stats
        per_byte = s.restore_seconds / s.restored_bytes if s.restored_bytes else FIRST_GUESS_SECONDS_PER_BYTE
        return per_byte * self.entries[key].nbytes

    def restored(self, key: int, seconds: float, ok: bool) -> None:
        """A restore of `key` was made (`ok`; else refused by the target, which prefilled instead) and took
        `seconds`."""
        e = self.entries.get(key)
        if not ok:
            self.stats.failed_restores += 1
            return
        self.stats.restores += 1
        if e is not None and seconds > 0:
            self._tick += 1
            e.last_used = self._tick
            self.stats.restore_seconds += seconds
            self.stats.restored_bytes += e.nbytes

    def clear(self) -> list[int]:
        """Forget every entry (the target's stash is gone or must be emptied); returns their keys."""
        keys = list(self.entries)
        self.entries.clear()
        self.index = RadixIndex()
        self.bytes = 0
        return keys

    def to_dict(self) -> dict:
        s = self.stats
        return {"enabled": self.enabled, "budget_mib": round(self.budget_bytes / 2**20, 1),
                "entries": len(self.entries), "bytes": self.bytes, "kept_bytes": self.kept_bytes,
                "saves": s.saves, "restores": s.restores,
                "failed_restores": s.failed_restores, "evictions": s.evictions,
                "restore_ms_per_mib": round(1000 * s.restore_seconds / (s.restored_bytes / 2**20), 3)
                if s.restored_bytes else None}
