"""The HTTP bench's in-process row (bench/http_local.py) prefills every prompt in full, as the HTTP client asks
the servers to (`cache_prompt: false`): a prompt it saw before (the warm-up's, an earlier row's) must not skip
its prefill there alone."""

from __future__ import annotations

from specray.bench.http_local import run_in_process
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.scheduler import LEARN_BATCH

PROMPTS = [{"messages": [{"role": "user", "content": "Name three rivers in Europe."}]},
           {"messages": [{"role": "user", "content": "What is 12 times 7?"}]}]


def test_the_in_process_row_reuses_no_cached_prompt(smollm2):
    cfg = EngineConfig(model="smollm2-135m", slots=2, n_ctx=1024, calibrate=False,
                       chain=ChainConfig(speculators=[]))
    eng = LocalEngine(cfg, model=smollm2)
    try:
        cache = eng.scheduler.prefix_cache.idle
        assert cache.enabled  # on by default: the rows must opt out, as the HTTP client does
        rounds0 = eng.runner.rounds
        first = run_in_process(eng, PROMPTS, 1, 5)
        # the row's figures count every round it ran, each learnt into the stats before they are read: the last
        # ones, short of a batch (Scheduler's LEARN_BATCH), too
        assert first["rounds"] == eng.runner.rounds - rounds0 > 0 and first["rounds"] % LEARN_BATCH
        again = run_in_process(eng, PROMPTS, 2, 5)  # the same prompts, their KV still in the slots
        assert first["requests"] == again["requests"] == 2 and first["completion_tokens"] > 0
        assert cache.hits == 0 and cache.reused_tokens == 0
        # the control: the same prompt asked with the cache on does reuse the slot's KV
        seq = eng.submit(eng.request(messages=PROMPTS[0]["messages"], max_tokens=4))
        while not seq.finished:
            eng.step()
        assert cache.hits == 1 and seq.cached_tokens > 0
    finally:
        eng.close()
