"""A server process's heap and Python's cyclic garbage collector: what start-up left frozen, and the collector's
pauses counted.

A server process starts with a large heap that lives as long as it does: Ray, Serve, FastAPI, pydantic's
models, the engine. The collector walks every object it tracks at each full collection (one whenever the
objects that survived into its oldest generation have grown by a quarter since the last), and every thread of
the process waits for it, the round thread too: every stream stalls. `freeze_startup` moves what start-up left
into the collector's permanent generation (`gc.freeze`, as vLLM does once its engine is up), so a full
collection walks only what serving made since. The cost: a start-up object that later becomes cyclic garbage is
never collected; start-up's own garbage is collected first.

`watch()` counts and times the collections of this process by generation (`gc.callbacks`), for /v1/stats.

>>> p = GcPauses(); p.collected(0, 0.0002); p.collected(2, 0.0801); p.collected(2, 0.0005)
>>> p.snapshot()["collections"], p.snapshot()["ms"], p.snapshot()["longest_ms"]
([1, 0, 2], [0.2, 0.0, 80.6], [0.2, 0.0, 80.1])
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("specray.heap")


def freeze_startup() -> int:
    """Collect start-up's garbage, then freeze every object left (none of them is walked by a collection from
    now on); returns how many objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the collector's generations", n)
    return n


class GcPauses:
    """This process's collections since it was made, by generation (0, 1, 2): how many, their time, the
    longest; and the objects frozen (`freeze_startup`)."""

    def __init__(self) -> None:
        self.n = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def callback(self, phase: str, info: dict) -> None:
        """gc.callbacks' hook: a collection starts or ends (the collector holds the GIL meanwhile, so one
        collection runs at a time)."""
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collected(info["generation"], time.perf_counter() - self._t0)

    def collected(self, generation: int, seconds: float) -> None:
        self.n[generation] += 1
        self.seconds[generation] += seconds
        self.longest[generation] = max(self.longest[generation], seconds)

    def snapshot(self) -> dict:
        """{"collections": per generation, "ms": their time in all, "longest_ms", "frozen": objects frozen}."""
        return {"collections": list(self.n), "ms": [round(1e3 * s, 3) for s in self.seconds],
                "longest_ms": [round(1e3 * s, 3) for s in self.longest], "frozen": gc.get_freeze_count()}


_watch: GcPauses | None = None
_lock = threading.Lock()


def watch() -> GcPauses:
    """This process's GcPauses, its hook installed on the first call."""
    global _watch
    with _lock:
        if _watch is None:
            _watch = GcPauses()
            gc.callbacks.append(_watch.callback)
        return _watch
