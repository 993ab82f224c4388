"""PromptCache's record of idle slots (engine/prompt_cache.py); the engine's use of it: tests/integration."""

from __future__ import annotations

import doctest

import numpy as np

from specray.engine import prompt_cache
from specray.engine.prompt_cache import PromptCache


def test_doctests():
    assert doctest.testmod(prompt_cache).failed == 0


def test_the_record_of_idle_slots():
    pc = PromptCache()
    assert pc.keep(0, np.arange(10, dtype=np.int32))
    assert pc.pick([0, 1], np.arange(12, dtype=np.int32), use=False) == (1, 0)
    assert pc.pick([0, 1], np.arange(12, dtype=np.int32)) == (0, 10)
    pc.claim(0, 10, True)
    assert pc.stats()["hits"] == 1 and pc.stats()["idle_slots"] == 0
    off = PromptCache(enabled=False)
    assert not off.keep(0, np.arange(10, dtype=np.int32)) and off.pick([0], np.arange(5, dtype=np.int32)) == (0, 0)


def test_eviction_is_least_recently_used_and_spares_the_chosen_slot():
    pc = PromptCache()
    for slot, n in ((0, 100), (1, 50), (2, 80)):
        pc.keep(slot, np.arange(n, dtype=np.int32))
    freed: list[int] = []
    pc.evict(100, freed.append, but=0)  # 1 and 2 hold 130 > 100: the older, 1, goes (0 is older but spared)
    assert freed == [1] and sorted(pc.slots) == [0, 2] and pc.idle_cells() == 180 and pc.evicted == 1
    pc.evict(-1, freed.append)  # a forced clear: all of them, not counted as evictions
    assert freed == [1, 0, 2] and pc.idle_cells() == 0 and pc.evicted == 1
