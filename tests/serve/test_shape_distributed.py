"""Shape-stable verifies in distributed mode: the option reaches the target actor, which pads the rounds the
router's scheduler sends it, and output stays token-identical to target-only decoding (exact mode)."""

from __future__ import annotations

import uuid

import pytest

from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest
from specray.engine.sampling import SamplingParams

from ..conftest import spec_bench_prompts

pytestmark = [pytest.mark.serve, pytest.mark.model]

SLOTS = 4


def test_bucketed_verifies_in_the_target_actor_are_lossless(ray_serve, smollm2):
    import ray

    from specray.deployments.actors.launch import start_actors
    from specray.deployments.builder import build_engine
    from specray.deployments.config import ServeConfig
    from specray.deployments.local_engine import LocalEngine

    spec = ("ngram_mod", "suffix")
    cfg = EngineConfig(model="smollm2-135m", slots=SLOTS, n_ctx=512 * SLOTS, exact=True, calibrate=False,
                       verify_shape="bucketed", chain=ChainConfig(speculators=list(spec), policy="first", n_max=8))
    plain = LocalEngine(cfg.model_copy(update={"verify_shape": "exact"}), model=smollm2)
    prompts = [plain.prompt_tokens(messages=[{"role": "user", "content": p}]) for p in spec_bench_prompts(6)]

    def reqs(chain):
        return [GenerationRequest(prompt_tokens=t, max_tokens=48, sampling=SamplingParams(), chain=chain)
                for t in prompts]

    base = [s.generated for s in plain.run(reqs(()))]
    plain.close()
    serve_cfg = ServeConfig(mode="distributed", engine=cfg, target_cpus=0.4, companion_cpus=0.1,
                            actor_start_timeout_s=600)
    actors = start_actors(serve_cfg, tag=f"shape-test-{uuid.uuid4().hex[:6]}")
    try:
        parts = build_engine(cfg, actors=actors)
        seqs = parts.scheduler.run(reqs(spec))
        assert [s.generated for s in seqs] == base
        assert sum(s.spec_total.accepted for s in seqs) > 0
        c = ray.get(actors.target.handle.counters.remote())
        assert c["verify_buckets"] == list(cfg.verify_buckets) and c["pad_rows"] > 0
    finally:
        actors.close()
