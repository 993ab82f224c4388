"""The agent workload in process, with attention tile pads on and off: two engines on one model (the defaults
of `specray serve --slots 4`: fast mode, flash attention, the default chain, calibrated at start), each running
the same conversations closed-loop, C at a time, a conversation's next turn sent when its answer is done. Time
to first token is the scheduler's: a request's submit to its first token. The engines run in the order
A B B A over two sets of conversations (the first half's on A then B, the second half's on B then A), so the
machine's drift hits both alike and no engine meets a conversation it has cached.

Run: .venv/bin/python bench/results/2026-12-04-tile-pads-agents.py OUT.json [AGENTS] [TURNS] [CONCURRENCY]
"""
import json
import statistics
import sys
import time

from specray.bench.agents import agent_users, system_prompt
from specray.bench.multiturn import turn_messages
from specray.bench.prompts import default_prompts_path
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import EngineConfig
from specray.native.model import Model

out_path = sys.argv[1]
n_agents, n_turns, conc = (int(a) for a in (sys.argv[2:] + ["8", "3", "4"][len(sys.argv) - 2:])[:3])
system = system_prompt(1600)
users = agent_users(default_prompts_path(), 2 * n_agents, n_turns)
halves = [users[:n_agents], users[n_agents:]]
model = Model("smollm2-135m")
engines = {pads: LocalEngine(EngineConfig(model="smollm2-135m", slots=4, tile_pads=pads), model=model)
           for pads in (True, False)}


def run(engine: LocalEngine, convs: list[list[str]]) -> dict:
    """Every conversation of `convs`, `conc` at a time; per request its turn, TTFT and cached tokens."""
    answers: dict[int, list[str]] = {k: [] for k in range(len(convs))}
    running: dict[int, object] = {}  # conversation -> its current Sequence
    waiting = list(range(len(convs)))
    records = []
    pads0 = engine.scheduler.stats.tile_pads

    def send(k: int) -> None:
        t = len(answers[k])
        msgs = [{"role": "system", "content": system}] + turn_messages(convs[k], answers[k], t)
        running[k] = engine.submit(engine.request(messages=msgs, max_tokens=48))

    t0 = time.perf_counter()
    while waiting and len(running) < conc:
        send(waiting.pop(0))
    while running:
        engine.step()
        for k, seq in list(running.items()):
            if not seq.finished:
                continue
            del running[k]
            records.append({"turn": len(answers[k]) + 1, "ttft_s": seq.t_first_token - seq.t_submit,
                            "prompt_tokens": len(seq.req.prompt_tokens), "cached_tokens": seq.cached_tokens,
                            "tokens": len(seq.generated)})
            answers[k].append(seq.text)
            if len(answers[k]) < n_turns:
                send(k)
            elif waiting:
                send(waiting.pop(0))
    wall = time.perf_counter() - t0

    def pct(turns, q):  # nearest rank
        v = sorted(r["ttft_s"] for r in records if (r["turn"] == 1) == (turns == "first"))
        return statistics.median(v) if q == 0.5 else v[round(q * (len(v) - 1))]

    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in records), "records": records,
            "first_p50_s": pct("first", 0.5), "first_p90_s": pct("first", 0.9),
            "later_p50_s": pct("later", 0.5), "later_p90_s": pct("later", 0.9),
            "tile_pads": engine.scheduler.stats.tile_pads - pads0}


runs = []
for half, order in ((0, (True, False)), (1, (False, True))):
    for pads in order:
        r = run(engines[pads], halves[half])
        r |= {"tile_pads_on": pads, "conversations": f"half {half + 1}"}
        runs.append(r)
        print(f"pads {'on ' if pads else 'off'} half {half + 1}: wall {r['wall_s']:.1f} s, TTFT first p50/p90 "
              f"{r['first_p50_s']:.2f}/{r['first_p90_s']:.2f} s, later p50/p90 {r['later_p50_s']:.2f}/"
              f"{r['later_p90_s']:.2f} s, padded rounds {r['tile_pads']}", flush=True)
cost = engines[True].scheduler.policy.cost
meta = {"agents": n_agents, "turns": n_turns, "concurrency": conc, "system_tokens": 1600, "max_tokens": 48,
        "attention_ns_per_token_cell": cost.attn_seconds * 1e9,
        "tile_attention_ns_per_token_cell": cost.tile_attn_seconds * 1e9,
        "subtile_attention_ns_per_token_cell": cost.subtile_attn_seconds * 1e9,
        "kernel_fit": {"below": engines[True].scheduler.tile_fit.below, "tile": engines[True].scheduler.tile_fit.tile}}
json.dump({"meta": meta, "runs": runs}, open(out_path, "w"), indent=1)
print(json.dumps(meta))
for e in engines.values():
    e.close()
