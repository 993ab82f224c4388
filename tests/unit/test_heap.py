"""deployments/heap.py: the collector's pauses counted by generation, and start-up's heap frozen out of its
generations. (A served replica freezes at start and reports the counts in /v1/stats: tests/serve/test_load.py.)"""

from __future__ import annotations

import doctest
import gc

from specray.deployments import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector can free it


def test_watch_counts_and_times_each_generations_collections_and_installs_its_hook_once():
    w = heap.watch()
    assert heap.watch() is w and gc.callbacks.count(w.callback) == 1
    before = w.snapshot()
    gc.collect(0)
    gc.collect(2)
    after = w.snapshot()
    assert after["collections"][0] >= before["collections"][0] + 1
    assert after["collections"][2] >= before["collections"][2] + 1
    assert after["ms"][2] > before["ms"][2] and after["longest_ms"][2] > 0


def test_a_frozen_heap_is_out_of_the_collectors_generations_and_garbage_made_later_is_still_freed():
    try:
        kept = [Node() for _ in range(5_000)]  # start-up's objects
        for _ in range(300):
            Node()  # start-up's garbage: collected before the freeze
        n = heap.freeze_startup()
        assert n >= len(kept) and gc.get_freeze_count() == n
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in kept[:100])  # a full collection no longer walks them
        gc.collect()
        for _ in range(300):
            Node()  # serving's garbage
        assert gc.collect() >= 300  # collected as before the freeze
    finally:
        gc.unfreeze()


def test_doctests():
    failed, attempted = doctest.testmod(heap)
    assert attempted and not failed
