"""ngram_cache with its once-seen n-grams kept as ints against the same speculator with a dict for every n-gram
(benchmarks page, "ngram_cache's once-seen n-grams"), in one process, on Spec-Bench's 480 questions.

Each question is a sequence: its chat-templated prompt's first 80% is counted as the target prefills it
(`begin`, then `prefilling` in 256-token chunks), the rest is "generated": each round asks for a draft (up to 8
tokens), accepts the longest prefix that matches the text and one more token, as a target would. Its end merges
the sequence's table (the default `keep_finished`: the oldest kept table is merged when a newer one pushes it
out). The two versions run the same sequences, alternating in blocks of 40 questions, fresh speculators each
repetition; every draft must be the same in both. Times are means over all the sequences (set-up and end a
sequence, draft a look-up), the median of the repetitions. Timed with time.perf_counter around the public calls, warm (a
tight loop: a served round's caches are colder). Memory: tracemalloc over one speculator that ran every question,
its dynamic and kept tables included.

    .venv/bin/python bench/results/2026-12-05-ngram-cache-entries.py OUT.json [BEFORE_COMMIT]

BEFORE_COMMIT (default 5291aee) names the commit whose engine/speculators/ngram_cache.py is the dict version.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from specray.engine.speculator import DraftRequest
from specray.native.model import Model
from specray.native.models import resolve_model

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 40
REPS = 5


def load_before(commit: str):
    """The module as it was at `commit`, importable beside today's (its relative imports made absolute)."""
    src = subprocess.run(["git", "show", f"{commit}:engine/speculators/ngram_cache.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from ._util", "from specray.engine.speculators._util")
    src = src.replace("from .kept_states", "from specray.engine.speculators.kept_states")
    path = Path(tempfile.mkdtemp()) / "ngram_cache_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("ngram_cache_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def prompts() -> list[np.ndarray]:
    model = Model(resolve_model("smollm2-135m"), vocab_only=True)
    out = []
    with open(ROOT / "bench/data/spec_bench.jsonl") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append(np.asarray(model.chat_tokens([{"role": "user", "content": q["turns"][0]}]), np.int32))
    model.close()
    return out


def run(spec, seq_id: int, toks: np.ndarray, t: dict, drafts: list) -> None:
    """One sequence through `spec`'s public calls, its times added to `t`, its drafts appended to `drafts`."""
    cut = max(2, int(len(toks) * 0.8))
    t0 = time.perf_counter()
    spec.begin(seq_id, toks[:cut])
    for n in range(256, cut + 256, 256):
        spec.prefilling(seq_id, min(n, cut))
    t1 = time.perf_counter()
    t["setup"] += t1 - t0
    pos = cut
    while pos < len(toks):
        t0 = time.perf_counter()
        (d,) = spec.draft([DraftRequest(seq_id, toks[:pos], 8)])
        t["draft"] += time.perf_counter() - t0
        t["drafts"] += 1
        drafts.append(d.tolist())
        acc = 0
        for i, x in enumerate(d.tolist()):
            if pos + i < len(toks) and toks[pos + i] == x:
                acc += 1
            else:
                break
        if len(d):
            spec.accept(seq_id, len(d), acc, True)
        pos += acc + 1
    t0 = time.perf_counter()
    spec.end(seq_id)
    t["end"] += time.perf_counter() - t0


def main() -> None:
    out_path = sys.argv[1]
    commit = sys.argv[2] if len(sys.argv) > 2 else "5291aee"
    from specray.engine.speculators import ngram_cache as after

    versions = {"dict entries": load_before(commit), "once-seen ints": after}
    seqs = prompts()
    print(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens", file=sys.stderr)
    # per repetition: set-up and end ms a sequence, draft ms a look-up, each over all the sequences
    times = {v: {"setup": [], "draft": [], "end": []} for v in versions}
    same = True
    for rep in range(REPS):
        specs = {v: m.NgramCacheSpeculator() for v, m in versions.items()}
        totals = {v: {"setup": 0.0, "draft": 0.0, "end": 0.0, "drafts": 0} for v in versions}
        for b in range(0, len(seqs), BLOCK):
            order = list(versions) if (rep + b // BLOCK) % 2 == 0 else list(versions)[::-1]
            block_drafts = {}
            for v in order:
                block_drafts[v] = []
                for i, toks in enumerate(seqs[b : b + BLOCK]):
                    run(specs[v], b + i, toks, totals[v], block_drafts[v])
            a, c = block_drafts.values()
            same = same and a == c
        for v, t in totals.items():
            times[v]["setup"].append(t["setup"] / len(seqs) * 1e3)
            times[v]["draft"].append(t["draft"] / max(1, t["drafts"]) * 1e3)
            times[v]["end"].append(t["end"] / len(seqs) * 1e3)
        print(f"repetition {rep + 1}/{REPS} done", file=sys.stderr)
    memory = {}
    n_tokens = sum(map(len, seqs))
    for v, m in versions.items():
        gc.collect()
        tracemalloc.start()
        spec = m.NgramCacheSpeculator()
        t = {"setup": 0.0, "draft": 0.0, "end": 0.0, "drafts": 0}
        for i, toks in enumerate(seqs):
            run(spec, i, toks, t, [])
        kept_bytes = tracemalloc.get_traced_memory()[0]
        spec.merge_kept()
        gc.collect()
        memory[v] = {"bytes_per_token_all_merged": tracemalloc.get_traced_memory()[0] / n_tokens,
                     "bytes_per_token_with_kept": kept_bytes / n_tokens, "dynamic_ngrams": len(spec.dynamic)}
        tracemalloc.stop()
        del spec
    res = {"command": " ".join(["bench/results/2026-12-05-ngram-cache-entries.py", *sys.argv[1:]]),
           "machine": platform.processor() or platform.machine(), "before_commit": commit,
           "sequences": len(seqs), "tokens": n_tokens, "reps": REPS, "same_drafts": same,
           "median_ms": {v: {k: statistics.median(x) for k, x in d.items()} for v, d in times.items()},
           "repetitions_ms": times, "memory": memory}
    Path(out_path).write_text(json.dumps(res, indent=1))
    for v in versions:
        med = res["median_ms"][v]
        print(f"{v:15s} set-up {med['setup']:.3f} ms a sequence, draft {med['draft'] * 1e3:.1f} us a look-up, "
              f"end {med['end']:.3f} ms; {memory[v]['bytes_per_token_all_merged']:.0f} bytes a token merged, "
              f"{memory[v]['bytes_per_token_with_kept']:.0f} with the kept tables")
    print(f"same drafts: {same}")


if __name__ == "__main__":
    main()
