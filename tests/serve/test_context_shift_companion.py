"""Context shift with the `draft` speculator in the companion actor (real Ray actor, real models): the
companion's draft cache shifts as the target's KV did (the proxy sends the shift ahead of later commits), its
mirror stays the target's shifted token list, and greedy output equals plain decoding (exact target)."""

from __future__ import annotations

import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts
from .test_draft_companion import attach, start_companion

pytestmark = [pytest.mark.serve, pytest.mark.model]

SLOTS, CELLS, MAX_TOKENS = 2, 256, 400


def config(draft: str | None) -> EngineConfig:
    return EngineConfig(model="smollm2-135m", slots=SLOTS, n_ctx=CELLS * SLOTS, exact=True, calibrate=False,
                        context_shift=True, chain=ChainConfig(speculators=[], policy="first", n_max=8),
                        draft=DraftModelConfig(model=draft))


def test_companion_draft_cache_follows_the_shift(ray_serve, smollm2):
    import ray

    prompts = spec_bench_prompts(SLOTS)

    def requests(eng, chain):
        return [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                            ignore_eos=True) for p in prompts]

    eng = LocalEngine(config(None), model=smollm2)
    base = [s.generated for s in eng.run(requests(eng, ()))]
    ecfg = config("smollm2-135m")
    client = start_companion(ecfg)
    try:
        proxy = attach(eng, client, ecfg)
        seqs = [eng.submit(r) for r in requests(eng, ("draft",))]
        checked = 0
        while eng.scheduler.has_work():
            eng.step()
            live = {k: s for k, s in eng.scheduler.active.items() if s.state == SeqState.DECODING and s.shifts}
            if not live:
                continue
            assert proxy.flush()
            pos = ray.get(client.sup.handle.positions.remote(list(live), False))
            for slot, seq in live.items():
                if slot in pos:
                    kv_target = seq.kv_history()[: seq.n_past].tolist()
                    assert pos[slot]["committed"] == kv_target
                    assert pos[slot]["kv_tokens"] == kv_target[: len(pos[slot]["kv_tokens"])]
                    checked += 1
        assert checked > 0
        assert [s.generated for s in seqs] == base and all(s.shifts >= 2 for s in seqs)
        assert sum(s.spec_by_name["draft"].accepted for s in seqs if "draft" in s.spec_by_name) > 0
        c = ray.get(client.sup.handle.counters.remote())
        assert c["unsynced"] == 0 and proxy.unsynced == 0 and proxy.failed_calls == 0
    finally:
        client.sup.close()
        eng.close()
