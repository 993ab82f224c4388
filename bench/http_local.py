"""The in-process reference row of the HTTP bench: LocalEngine, same prompts, same concurrency.

`c` streams in-process = at most `c` requests in the scheduler at once, a new
one submitted as soon as one finishes (what `c` HTTP clients do to a server),
with no HTTP, Serve or actor in between. The snapshot has /v1/stats' shape,
so `http_bench.window_figures` computes its rounds and batch widths exactly as
for the servers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

from specray.bench.http_client import Prompt, aggregate, window_figures
from specray.deployments.local_engine import LocalEngine


def snapshot(engine: LocalEngine) -> dict:
    r = engine.runner
    return {
        "mode": "in-process",
        "scheduler": asdict(engine.scheduler.stats),
        "target": {"where": "in-process", "rounds": r.rounds, "multi_seq_decodes": r.multi_seq_decodes,
                   "step_decodes": r.step_decodes, "step_decode_seqs": r.step_decode_seqs},
    }


def run_in_process(engine: LocalEngine, prompts: list[Prompt], concurrency: int, max_tokens: int) -> dict:
    # tokenized up front: the servers tokenize too, but that is microseconds next to a decode. No prompt cache, as
    # the HTTP client asks of the servers (http_client.request_body): else the warm-up's prompt, or an earlier
    # row's, would skip its prefill here only and flatter the in-process row
    reqs = deque(engine.request(p.get("prompt"), p.get("messages"), max_tokens=max_tokens, cache_prompt=False)
                 for p in prompts)
    results: list[dict] = []
    inflight: dict[int, list] = {}  # id(seq) -> [seq, submitted at, first token at]
    before = snapshot(engine)
    t0 = time.perf_counter()
    while reqs or inflight:
        while reqs and len(inflight) < concurrency:
            seq = engine.submit(reqs.popleft())
            inflight[id(seq)] = [seq, time.perf_counter(), None]
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            rec = inflight.get(id(ev.seq))
            if rec is not None and rec[2] is None and ev.text:
                rec[2] = now
        for key, (seq, t_sub, t_first) in list(inflight.items()):
            if seq.finished:
                del inflight[key]
                st = seq.spec_total
                results.append({"seconds": now - t_sub, "ttft": None if t_first is None else t_first - t_sub,
                                "tokens": len(seq.generated),
                                "speculative": {"drafts": st.drafts, "drafted_tokens": st.drafted,
                                                "accepted_tokens": st.accepted}})
    wall = time.perf_counter() - t0
    while engine.scheduler.has_work():  # rounds not yet learnt into the stats (Scheduler.has_work)
        engine.step()
    return {"url": None, "mode": "in-process"} | aggregate(results, [], wall, concurrency) | \
        window_figures(before, snapshot(engine))
