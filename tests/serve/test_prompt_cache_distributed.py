"""The prefix cache with the target in its own Ray actor (distributed mode): slot copies, host-memory saves and
restores travel as the target actor's ordered slot operations (RemoteTarget) and the output does not change.

Exact mode, 2 slots, 4 conversations of 3 turns sharing one system prompt: caches must be saved to the host
tier in the target actor and restored for later turns. Every answer is compared with the same prompt decoded
in-process without any cache (exact mode: token-identical)."""

from __future__ import annotations

import uuid

import pytest

from specray.engine.config import ChainConfig, EngineConfig

from ..conftest import spec_bench_questions

pytestmark = [pytest.mark.serve, pytest.mark.model]

SYSTEM = ("You are a careful assistant with tools. Rules: " + " ".join(
    f"{i}. Answer kind {i} briefly and cite tool {i % 5}." for i in range(1, 9)))
FOLLOW_UP = "Now say it in one sentence."
MAX_TOKENS = 12


def _config(prompt_cache: bool) -> EngineConfig:
    return EngineConfig(model="smollm2-135m", slots=2, n_ctx=2048, exact=True, calibrate=False,
                        prompt_cache=prompt_cache, cache_ram=64,
                        chain=ChainConfig(speculators=["ngram_mod", "suffix"], policy="first", n_max=8))


def _conversations(n: int) -> list[list[str]]:
    multi = [q["turns"] for q in spec_bench_questions() if len(q.get("turns", ())) >= 2]
    return [list(t[:2]) + [FOLLOW_UP] for t in multi[:n]]


def test_host_tier_saves_and_restores_through_the_target_actor(ray_serve):
    from specray.deployments.actors.launch import start_actors
    from specray.deployments.builder import build_engine
    from specray.deployments.config import ServeConfig
    from specray.deployments.local_engine import LocalEngine

    cfg = _config(prompt_cache=True)
    serve_cfg = ServeConfig(mode="distributed", engine=cfg, target_cpus=0.4, companion_cpus=0.1,
                            actor_start_timeout_s=600)
    actors = start_actors(serve_cfg, tag=f"prefix-test-{uuid.uuid4().hex[:6]}")
    parts = build_engine(cfg, actors=actors)
    convs = _conversations(4)
    history = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    turns = []
    try:
        for t in range(3):
            for h, conv in zip(history, convs):
                h.append({"role": "user", "content": conv[t]})
            seqs = parts.scheduler.run([_request(parts.model.chat_tokens(h)) for h in history])
            for h, s in zip(history, seqs):
                h.append({"role": "assistant", "content": s.text})
            turns.append(seqs)
        stats = parts.scheduler.prefix_cache.stats()
    finally:
        parts.remote.close()
        actors.close()

    host = stats["host"]
    assert host["saves"] >= 2 and host["restores"] >= 1 and host["failed_restores"] == 0, host
    # a later turn found its whole history (held in host memory or a slot)
    assert any(s.cached_tokens >= len(p.req.prompt_tokens) for s, p in zip(turns[2], turns[1]))

    ref = LocalEngine(_config(prompt_cache=False))
    try:
        want = ref.run([_request(s.req.prompt_tokens) for seqs in turns for s in seqs])
    finally:
        ref.close()
    got = [s.generated for seqs in turns for s in seqs]
    assert got == [s.generated for s in want]


def _request(tokens):
    from specray.engine.request import GenerationRequest
    from specray.engine.sampling import SamplingParams

    return GenerationRequest(prompt_tokens=tokens, max_tokens=MAX_TOKENS, sampling=SamplingParams())
