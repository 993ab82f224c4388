"""What the model-free speculators' tables cost Python's cyclic garbage collector once a long-running server has
filled them (benchmarks page, "The speculators' tables and the garbage collector").

`suffix`, `ngram_cache` and `ngram_mod` with their default parameters serve Spec-Bench's 480 questions (both turns'
text, SmolLM2's tokenizer) as if each were an answer: a sequence begins with its first 16 tokens, then its
history grows 4 tokens at a time with a look-up of every speculator each time, as a round's drafting does,
and ends. 8 sequences take turns. PASSES passes over the questions fill the global trie (100,000 tokens) and the
dynamic n-gram table (250,000 n-grams) to their bounds, where eviction keeps them. Recorded: the collector's
automatic collections by generation (gc.callbacks: how many, their total and longest time) and the objects it
tracks, after each pass.

    .venv/bin/python bench/results/2026-12-05-gc-tables.py OUT.json [PASSES]
"""
import collections
import gc
import json
import sys
import time

import numpy as np

from specray.engine.speculator import DraftRequest
from specray.engine.speculators.registry import make_speculator
from specray.native.model import Model


def main(out_path: str, passes: int) -> None:
    model = Model("smollm2-135m", vocab_only=True)
    with open("bench/data/spec_bench.jsonl") as f:
        questions = [json.loads(line) for line in f]
    seqs = [np.asarray(model.tokenize(" ".join(q["turns"])), dtype=np.int32) for q in questions]
    seqs = [s for s in seqs if len(s) >= 40]
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    specs = [make_speculator(n) for n in ("suffix", "ngram_cache", "ngram_mod")]
    gc.collect()
    tracked0 = len(gc.get_objects())
    gc.callbacks.append(on_gc)
    result = {"command": "bench/results/2026-12-05-gc-tables.py", "passes": []}
    served = 0
    t_all = time.perf_counter()
    for p in range(passes):
        for i, toks in enumerate(seqs):
            sid = i % 8
            for s in specs:
                s.begin(sid, toks[:16])
            for end in range(20, len(toks) + 1, 4):
                for s in specs:
                    s.draft([DraftRequest(sid, toks[:end], 8)])
            for s in specs:
                s.end(sid)
            served += len(toks) - 16
        types = collections.Counter(type(o).__name__ for o in gc.get_objects())
        row = {"pass": p, "tokens_served": served, "seconds": round(time.perf_counter() - t_all, 1),
               "tracked_objects_added": len(gc.get_objects()) - tracked0,
               "top_tracked_types": dict(types.most_common(4)),
               "collections": {str(g): {"count": len(v), "total_ms": round(sum(v) * 1e3, 1),
                                        "longest_ms": round(max(v, default=0.0) * 1e3, 1)}
                               for g, v in pauses.items()}}
        result["passes"].append(row)
        print(json.dumps(row), flush=True)
    gc.callbacks.remove(on_gc)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
