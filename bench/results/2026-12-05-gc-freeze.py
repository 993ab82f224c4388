"""Python's cyclic garbage collector in a serving process, with the start-up heap frozen (gc.freeze) or not.

One process per run: it imports what an engine replica imports (Ray Serve, FastAPI, the deployments), builds the
engine (SmolLM2 in process, the default chain, 4 slots), then (MODE freeze) collects and freezes what start-up
left, then serves Spec-Bench's questions, 64 tokens each, 8 at a time through the 4 slots, REQUESTS in all.
Recorded with gc.callbacks while it serves: each generation's collections, their time and the longest, and the
objects the collector tracks before and after.

Run: .venv/bin/python bench/results/2026-12-05-gc-freeze.py OUT.json MODE REQUESTS   (MODE: plain | freeze)
"""
import gc
import json
import sys
import time

import specray.deployments.app  # noqa: F401  the replica's imports: the heap a replica starts with
from specray.bench.prompts import default_prompts_path, read_jsonl
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import EngineConfig


def main(out: str, mode: str, n_requests: int) -> None:
    eng = LocalEngine(EngineConfig(model="smollm2-135m", slots=4))
    qs = [q["turns"][0] for _, q in read_jsonl(default_prompts_path())]
    tracked0 = len(gc.get_objects())
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    start = [0.0]

    def watch(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - start[0])

    gc.callbacks.append(watch)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, n_requests, 8):
        reqs = [eng.request(messages=[{"role": "user", "content": qs[(i + j) % len(qs)]}], max_tokens=64)
                for j in range(min(8, n_requests - i))]
        tokens += sum(len(s.generated) for s in eng.run(reqs))
    wall = time.perf_counter() - t0
    gc.callbacks.remove(watch)
    r = {"mode": mode, "requests": n_requests, "tokens": tokens, "seconds": round(wall, 2),
         "tracked_at_start": tracked0, "frozen": gc.get_freeze_count(), "tracked_at_end": len(gc.get_objects()),
         "collections": {g: {"n": len(p), "ms": round(1e3 * sum(p), 2), "max_ms": round(1e3 * max(p, default=0), 3)}
                         for g, p in pauses.items()}}
    eng.close()
    print(json.dumps(r), flush=True)
    json.dump({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **r}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
