"""A conversation's later turns with the n-gram speculators' finished indexes kept (KEEP 16, the default) or not
(KEEP 0): SmolLM2 in process, the default chain, 4 slots, 4 conversations of 3 turns (two Spec-Bench user turns
and a follow-up) after one long system prompt, all conversations' turn t together, 64 tokens an answer. Per
speculator: the set-up time (`begin`) of the later turns (8 requests), the tokens they did not index again; the
round's admit stage; the later turns' time to first token (submission to first token, in process).

Run: .venv/bin/python bench/results/2026-12-05-kept-index.py OUT.json KEEP [KEEP ...]   (runs interleaved)
"""
import json
import statistics
import sys
import time

from specray.bench.prompts import default_prompts_path, read_jsonl
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.native.model import Model

SYSTEM = ("You are a careful assistant with tools. Rules: " + " ".join(
    f"{i}. Answer question kind {i} briefly, cite tool {i % 7}, and never invent a value for field f{i}."
    for i in range(1, 60)))
FOLLOW_UP = "Now say the same in two sentences."
NAMES = ("suffix", "ngram_cache")


def run(model, keep: int) -> dict:
    params = {n: {"keep_finished": keep} for n in NAMES}
    eng = LocalEngine(EngineConfig(model="smollm2-135m", slots=4, n_ctx=16384, chain=ChainConfig(params=params)),
                      model=model)
    multi = [q["turns"] for _, q in read_jsonl(default_prompts_path()) if len(q.get("turns", ())) >= 2][:4]
    convs = [list(t[:2]) + [FOLLOW_UP] for t in multi]
    hist = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    ttft, prompts, outs, begin_after_first = [], [], [], {}
    admit0 = rounds0 = 0.0
    for t in range(3):
        reqs = []
        for h, c in zip(hist, convs):
            h.append({"role": "user", "content": c[t]})
            reqs.append(eng.request(messages=list(h), max_tokens=64))
        seqs = eng.run(reqs)
        for h, s in zip(hist, seqs):
            h.append({"role": "assistant", "content": s.text})
        outs.append([s.generated for s in seqs])
        if t == 0:
            begin_after_first = {n: eng.chain.speculator(n).stats.time_begin_s for n in NAMES}
            admit0, rounds0 = eng.scheduler.stats.stage_seconds["admit"], eng.scheduler.stats.rounds
        else:
            ttft += [1e3 * (s.t_first_token - s.t_submit) for s in seqs]
            prompts += [len(s.req.prompt_tokens) for s in seqs]
    st = eng.scheduler.stats
    out = {"keep_finished": keep, "later_turn_prompt_tokens": prompts,
           "later_turn_ttft_ms": [round(x, 1) for x in ttft],
           "later_turn_ttft_ms_median": round(statistics.median(ttft), 1),
           "later_turns_admit_ms_per_round": round(
               1e3 * (st.stage_seconds["admit"] - admit0) / (st.rounds - rounds0), 4),
           "speculators": {n: {"later_turns_begin_ms_per_request": round(
               1e3 * (eng.chain.speculator(n).stats.time_begin_s - begin_after_first[n]) / 8, 3),
               "continued": eng.chain.speculator(n).stats.continued,
               "continued_tokens": eng.chain.speculator(n).stats.continued_tokens} for n in NAMES},
           "outputs": outs}
    eng.close()
    return out


if __name__ == "__main__":
    model = Model("smollm2-135m")
    runs = []
    for keep in (int(k) for k in sys.argv[2:]):
        r = run(model, keep)
        runs.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("outputs", "later_turn_ttft_ms")}))
    json.dump({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs}, open(sys.argv[1], "w"), indent=1)
