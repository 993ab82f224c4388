"""suffix, ngram_cache and ngram_mod with their compiled cores against the same speculators running the cores'
pure-Python references (benchmarks page, "Compiled cores for suffix's trie and ngram_cache's counts"; ngram_mod since
"More compiled cores: ngram_mod, the estimates, suffix's pick"), in one process, on Spec-Bench's 480 questions.

Each question is a sequence, as in 2026-12-05-ngram-cache-entries.py: its chat-templated prompt's first 80% is
indexed as the target prefills it (`begin`, then `prefilling` in 256-token chunks), the rest is "generated": each
round asks for a draft (up to 8 tokens) and accepts the longest prefix that matches the text and one more token.
Its end hands the sequence to the speculator's shared state (suffix: the global trie, built in slices over later
draft calls; ngram_cache: the kept tables, then the dynamic one). Compiled and reference alternate in blocks of
40 questions, fresh speculators each repetition; every draft must be the same in both. Times are means over all the
sequences (set-up and end a sequence, draft a look-up, its tries' or tables' upkeep included), the median of the
repetitions, timed with time.perf_counter around the public calls (warm: a tight loop, where a served round's
caches are colder).

    .venv/bin/python bench/results/2026-12-05-compiled-cores.py OUT.json
"""

from __future__ import annotations

import importlib.util
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from specray.engine.speculators import ngram_cache, ngram_mod, suffix
from specray.engine.speculators.ngram_cache import NgramCacheSpeculator, NgramCountTable
from specray.engine.speculators.ngram_mod import NgramModPool, NgramModSpeculator
from specray.engine.speculators.suffix import SuffixSpeculator, SuffixTrie

HERE = Path(__file__).resolve().parent
BLOCK = 40
REPS = 5


def load(name: str):
    """A sibling script as a module (its name starts with a date, not an identifier)."""
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the prompts and one sequence's run: the same as the once-seen-ints measurement's
entries = load("2026-12-05-ngram-cache-entries")
SPECULATORS = {"suffix": (SuffixSpeculator, SuffixTrie), "ngram_cache": (NgramCacheSpeculator, NgramCountTable),
               "ngram_mod": (NgramModSpeculator, NgramModPool)}


def main() -> None:
    assert suffix.COMPILED_CORE and ngram_cache.COMPILED_CORE and ngram_mod.COMPILED_CORE, \
        "the compiled cores are not built: pip install -e ."
    out_path = sys.argv[1]
    seqs = entries.prompts()
    print(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens", file=sys.stderr)
    modes = ("compiled", "reference")
    times = {s: {m: {"setup": [], "draft": [], "end": []} for m in modes} for s in SPECULATORS}
    same = {s: True for s in SPECULATORS}
    for rep in range(REPS):
        for name, (make, core_class) in SPECULATORS.items():
            specs = {m: make() for m in modes}
            totals = {m: {"setup": 0.0, "draft": 0.0, "end": 0.0, "drafts": 0} for m in modes}
            for b in range(0, len(seqs), BLOCK):
                order = modes if (rep + b // BLOCK) % 2 == 0 else modes[::-1]
                drafts = {}
                for m in order:
                    core_class.compiled = m == "compiled"
                    drafts[m] = []
                    for i, toks in enumerate(seqs[b : b + BLOCK]):
                        entries.run(specs[m], b + i, toks, totals[m], drafts[m])
                same[name] = same[name] and drafts["compiled"] == drafts["reference"]
            core_class.compiled = True
            for m, t in totals.items():
                times[name][m]["setup"].append(t["setup"] / len(seqs) * 1e3)
                times[name][m]["draft"].append(t["draft"] / max(1, t["drafts"]) * 1e3)
                times[name][m]["end"].append(t["end"] / len(seqs) * 1e3)
        print(f"repetition {rep + 1}/{REPS} done", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    res = {"command": " ".join(["bench/results/2026-12-05-compiled-cores.py", *sys.argv[1:]]), "commit": commit,
           "machine": platform.processor() or platform.machine(), "sequences": len(seqs),
           "tokens": sum(map(len, seqs)), "reps": REPS, "same_drafts": same,
           "median_ms": {s: {m: {k: statistics.median(x) for k, x in d.items()} for m, d in v.items()}
                         for s, v in times.items()},
           "repetitions_ms": times}
    Path(out_path).write_text(json.dumps(res, indent=1))
    for s in SPECULATORS:
        for m in modes:
            med = res["median_ms"][s][m]
            print(f"{s:12s} {m:10s} set-up {med['setup']:.3f} ms a sequence, draft {med['draft'] * 1e3:.1f} us a "
                  f"look-up, end {med['end']:.3f} ms")
    print(f"same drafts: {same}")


if __name__ == "__main__":
    main()
