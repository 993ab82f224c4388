"""The suffix trie's own speed with the garbage collector off, flat (engine/speculators/suffix.py) against the
object-per-node trie it replaced (tests/unit/suffix_trie_reference.py): Spec-Bench's 480 questions (both turns'
text, SmolLM2's tokenizer) inserted 4 tokens at a time, then all removed; each trie twice, alternating
(benchmarks page, "The speculators' tables and the garbage collector").

    .venv/bin/python bench/results/2026-12-05-trie-speed.py OUT.json
"""
import gc
import json
import sys
import time

sys.path.insert(0, "tests/unit")
from suffix_trie_reference import ObjectSuffixTrie  # noqa: E402

from specray.engine.speculators.suffix import SuffixTrie  # noqa: E402
from specray.native.model import Model  # noqa: E402

model = Model("smollm2-135m", vocab_only=True)
with open("bench/data/spec_bench.jsonl") as f:
    seqs = [model.tokenize(" ".join(json.loads(line)["turns"])).tolist() for line in f]
gc.disable()
runs = []
for rep in range(2):
    for cls in (ObjectSuffixTrie, SuffixTrie):
        t = cls(64)
        t0 = time.perf_counter()
        for i, s in enumerate(seqs):
            for j in range(0, len(s), 4):
                t.extend(i, s[j : j + 4])
            t.finish(i)
        t1 = time.perf_counter()
        for i in range(len(seqs)):
            t.remove(i)
        t2 = time.perf_counter()
        runs.append({"trie": cls.__name__, "insert_ms": round((t1 - t0) * 1e3, 1),
                     "remove_ms": round((t2 - t1) * 1e3, 1)})
        print(runs[-1], flush=True)
with open(sys.argv[1], "w") as f:
    json.dump({"command": "bench/results/2026-12-05-trie-speed.py OUT.json", "tokens": sum(map(len, seqs)),
               "runs": runs}, f, indent=1)
