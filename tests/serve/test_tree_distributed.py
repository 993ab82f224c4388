"""Draft trees with the target in its own Ray actor (distributed mode): the trees travel in the round's step
items, the actor lends its branch ids, and the output is target-only output.

One slot, one KV pool with flash attention (the default, where trees run: deployments/builder.tree_seqs); the
answers may differ from the same prompts decoded in-process without speculation only at measured near-ties (fast
mode is not batch-invariant). Verify rows are priced nearly free so that trees are sent (as in tests/integration/test_tree_lossless.py)."""

from __future__ import annotations

import uuid

import pytest

from specray.engine.config import ChainConfig, EngineConfig

from ..conftest import spec_bench_prompts

pytestmark = [pytest.mark.serve, pytest.mark.model]

MAX_TOKENS = 48


def _config() -> EngineConfig:
    return EngineConfig(model="smollm2-135m", slots=1, n_ctx=2048, calibrate=False, record_margins=True,
                        chain=ChainConfig(speculators=["suffix", "ngram_cache"], n_max=8, trees=True,
                                          params={"suffix": {"min_match": 1, "p_min": 0.01}}))


def test_trees_through_the_target_actor_are_target_only_output(ray_serve):
    from specray.deployments.actors.launch import start_actors
    from specray.deployments.builder import build_engine
    from specray.deployments.config import ServeConfig
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.cost import DecodeCostModel
    from specray.engine.policy.host_cost import HostCostModel

    cfg = _config()
    serve_cfg = ServeConfig(mode="distributed", engine=cfg, target_cpus=0.4, companion_cpus=0.1,
                            actor_start_timeout_s=600)
    actors = start_actors(serve_cfg, tag=f"tree-test-{uuid.uuid4().hex[:6]}")
    parts = build_engine(cfg, actors=actors)
    prompts = spec_bench_prompts(6)
    try:
        assert parts.scheduler.memory.tree_seqs == cfg.tree_branches  # the actor's context has the branch ids
        parts.scheduler.cost = DecodeCostModel({1: 0.010, 64: 0.0105}, learn=False)
        parts.scheduler.policy.pricer.host = HostCostModel(learn=False)
        parts.scheduler.policy.trees.gate.LEARN = 1 << 30  # runner-ups always looked up, paying or not
        seqs = parts.scheduler.run([_request(parts.model.chat_tokens([{"role": "user", "content": p}]))
                                    for p in prompts])
        trees = parts.scheduler.policy.snapshot()["trees"]
    finally:
        parts.remote.close()
        actors.close()
    assert trees["tree_rounds"] > 0, trees
    assert sum(sum(c["accepted_by_rank"][1:]) for c in trees["by_speculator"].values()) > 0, trees

    from specray.bench.run import classify_divergence, measure_batch_variance

    from ..integration.test_tree_lossless import layout_variance

    ref = LocalEngine(cfg)
    try:
        prefix = seqs[0].req.prompt_tokens
        tie_bound = 2.0 * max(measure_batch_variance(ref, prefix), layout_variance(ref.model, prefix))
        want = ref.run([_request(s.req.prompt_tokens, chain=()) for s in seqs])
    finally:
        ref.close()
    kinds = [classify_divergence(w.generated, s.generated, w.margins, tie_bound) for w, s in zip(want, seqs)]
    assert "mismatch" not in kinds, kinds


def _request(tokens, chain=None):
    from specray.engine.request import GenerationRequest

    return GenerationRequest(prompt_tokens=tokens, max_tokens=MAX_TOKENS, chain=chain)
