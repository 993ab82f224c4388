"""A long prompt admitted beside running conversations: the host time of the rounds its prefill spans (SmolLM2 in
process, the default chain, 4 slots). Three Spec-Bench questions decode (300 tokens each); once they all do, a
prompt of N tokens (Spec-Bench's questions run together) arrives. Per round from its admission to the end of its
prefill: host ms (the round less the target's decode, from the round stages) and the admit stage's share; the
largest round is what every running stream waits on top of that round's decode. The speculators' set-up time in
all (`time_begin_s`, begin and prompt indexing) is the same work however it is spread.

Run: .venv/bin/python bench/results/2026-12-05-long-prompt-rounds.py OUT.json LABEL N [N ...]
"""
import json
import sys
import time

from specray.bench.prompts import default_prompts_path, read_jsonl
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import EngineConfig
from specray.engine.request import GenerationRequest
from specray.native.model import Model

NAMES = ("ngram_mod", "suffix", "ngram_cache")


def host_ms(before: dict, after: dict) -> tuple[float, float, float]:
    """(host ms, admit ms, decode ms) of the rounds between two snapshots of the stage seconds."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return (1e3 * (sum(d.values()) - d.get("decode", 0.0)), 1e3 * d.get("admit", 0.0), 1e3 * d.get("decode", 0.0))


def run(model, n_long: int) -> dict:
    eng = LocalEngine(EngineConfig(model="smollm2-135m", slots=4, n_ctx=4 * 8192), model=model)
    qs = [q["turns"][0] for _, q in read_jsonl(default_prompts_path())]
    text = "\n\n".join(qs)
    long_tokens = eng.prompt_tokens(text)[:n_long]
    shorts = [eng.submit(eng.request(messages=[{"role": "user", "content": q}], max_tokens=300, ignore_eos=True))
              for q in qs[:3]]
    st = eng.scheduler.stats
    while not all(s.generated for s in shorts):
        eng.step()
    begin0 = {n: eng.chain.speculator(n).stats.time_begin_s for n in NAMES}
    long = eng.submit(GenerationRequest(long_tokens, max_tokens=8))
    rounds = []
    while not long.generated and not long.finished:
        snap = dict(st.stage_seconds)
        eng.step()
        rounds.append(host_ms(snap, st.stage_seconds))
    while eng.scheduler.has_work():
        eng.step()
    out = {"prompt_tokens": int(len(long_tokens)), "rounds": len(rounds),
           "first_round": {"host_ms": round(rounds[0][0], 3), "admit_ms": round(rounds[0][1], 3),
                           "decode_ms": round(rounds[0][2], 3)},
           "max_host_ms": round(max(r[0] for r in rounds), 3),
           "mean_host_ms": round(sum(r[0] for r in rounds) / len(rounds), 3),
           "mean_decode_ms": round(sum(r[2] for r in rounds) / len(rounds), 3),
           "host_ms_per_round": [round(r[0], 3) for r in rounds],
           "begin_ms": {n: round(1e3 * (eng.chain.speculator(n).stats.time_begin_s - begin0[n]), 3) for n in NAMES},
           "outputs": [s.generated for s in shorts] + [long.generated]}
    eng.close()
    return out


if __name__ == "__main__":
    model = Model("smollm2-135m")
    runs = []
    for n in (int(k) for k in sys.argv[3:]):
        r = run(model, n)
        r["label"] = sys.argv[2]
        runs.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("outputs", "host_ms_per_round")}), flush=True)
    json.dump({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs}, open(sys.argv[1], "w"), indent=1)
