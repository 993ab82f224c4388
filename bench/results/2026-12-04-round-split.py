"""Where the n-gram chain's host time goes inside a round, in place: the draft policy's entry points, the chain's
look-ups and the scheduler's stages, each timed by a wrapper around the method (about a microsecond each), in a
real in-process run: SmolLM2, `specray serve`'s defaults with the chain ngram_mod,suffix,ngram_cache, 2 prompts
per held-out Spec-Bench category, 96 tokens, one request at a time (SLOTS 1) or all at once. Microseconds a
round: a method's total over the rounds, per round; calls a round.

Run: .venv/bin/python bench/results/2026-12-04-round-split.py OUT.json [SLOTS]
"""
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict

from specray.bench.prompts import default_prompts_path, load_prompts
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.native.model import Model

seconds: dict[str, list[float]] = defaultdict(list)


def wrap(module: str, cls: str, name: str) -> None:
    owner = getattr(importlib.import_module(module), cls)
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[f"{cls}.{name}"].append(time.perf_counter() - t0)

    setattr(owner, name, timed)


for name in ("plan_round", "propose", "_ask", "accept", "observe"):
    wrap("specray.engine.policy.policy", "DraftPolicy", name)
for name in ("look_up", "accept"):
    wrap("specray.engine.chain", "Chain", name)
for name in ("_draft", "_emit", "_learn", "_admit"):
    wrap("specray.engine.scheduler", "Scheduler", name)
wrap("specray.engine.speculator", "Speculator", "draft")

out_path = sys.argv[1]
slots = int(sys.argv[2]) if len(sys.argv) > 2 else 1
eng = LocalEngine(EngineConfig(model="smollm2-135m", slots=slots,
                               chain=ChainConfig(speculators=["ngram_mod", "suffix", "ngram_cache"])),
                  model=Model("smollm2-135m"))
prompts = load_prompts(default_prompts_path(), ["coding", "math_reasoning", "qa", "rag", "summarization",
                                                "translation"], 2)
requests = [eng.request(messages=p.messages, prompt=p.prompt, max_tokens=96) for p in prompts]
seconds.clear()
r0 = eng.scheduler.stats.rounds
t0 = time.perf_counter()
if slots == 1:
    for r in requests:
        eng.run([r])
else:
    eng.run(requests)
wall = time.perf_counter() - t0
rounds = eng.scheduler.stats.rounds - r0
rows = {k: {"us_per_round": round(1e6 * sum(v) / rounds, 1), "calls_per_round": round(len(v) / rounds, 2),
            "us_per_call_median": round(1e6 * statistics.median(v), 1)} for k, v in sorted(seconds.items())}
for k, r in rows.items():
    print(f"{k:28s} {r['us_per_round']:8.1f} us a round  {r['calls_per_round']:5.2f} calls  "
          f"{r['us_per_call_median']:7.1f} us a call (median)")
json.dump({"slots": slots, "rounds": rounds, "wall_s": round(wall, 1), "methods": rows,
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}, open(out_path, "w"), indent=1)
eng.close()
