"""The host tier's saves in the agent workload, in process: 16 conversations of 3 turns sharing a 1,600-token
system prompt, 8 at a time on `specray serve --slots 4`'s defaults but a 256 MiB tier (about six 1,700-token
conversations, so it fills and drops), 32 tokens per answer, closed loop. Per save: its bytes, whether it got a
kept buffer (Context.recycle) and its seconds; then the tier's /v1/stats figures.

Run: .venv/bin/python bench/results/2026-12-04-host-save-agents.py OUT.json
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

N_AGENTS, N_TURNS, CONCURRENCY = 16, 3, 8
system = system_prompt(1600)
users = agent_users(default_prompts_path(), N_AGENTS, N_TURNS)
eng = LocalEngine(EngineConfig(model="smollm2-135m", slots=4, cache_ram=256), model=Model("smollm2-135m"))
ctx = eng.runner.ctx
saves = []
save_seq = ctx.save_seq


def timed_save(seq_id, allocate=None):
    reused, t0 = ctx.saved_buffers.reused, time.perf_counter()
    out = save_seq(seq_id, allocate)
    saves.append({"bytes": None if out is None else out.n_bytes, "reused": ctx.saved_buffers.reused > reused,
                  "ms": round(1e3 * (time.perf_counter() - t0), 2)})
    return out


ctx.save_seq = timed_save
answers = {k: [] for k in range(N_AGENTS)}
running, waiting = {}, list(range(N_AGENTS))


def send(k: int) -> None:
    msgs = [{"role": "system", "content": system}] + turn_messages(users[k], answers[k], len(answers[k]))
    running[k] = eng.submit(eng.request(messages=msgs, max_tokens=32))


while waiting and len(running) < CONCURRENCY:
    send(waiting.pop(0))
t0 = time.perf_counter()
while running:
    eng.step()
    for k, seq in list(running.items()):
        if seq.finished:
            del running[k]
            answers[k].append(seq.text)
            if len(answers[k]) < N_TURNS:
                send(k)
            elif waiting:
                send(waiting.pop(0))
host = eng.scheduler.prefix_cache.stats()["host"]
summary = {"wall_s": round(time.perf_counter() - t0, 1), "saves": len(saves),
           "reused": sum(s["reused"] for s in saves),
           "ms_reused_median": statistics.median([s["ms"] for s in saves if s["reused"]] or [0]),
           "ms_new_median": statistics.median([s["ms"] for s in saves if not s["reused"]] or [0]), "host": host}
print(json.dumps(summary))
json.dump({"summary": summary, "saves": saves, "started": time.strftime("%Y-%m-%d %H:%M:%S")},
          open(sys.argv[1], "w"), indent=1)
eng.close()
