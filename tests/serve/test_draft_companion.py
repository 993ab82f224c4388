"""The `draft` speculator in the companion actor (real Ray actor, real models).

The router side is the round scheduler with the target in-process (exact
mode) and `CompanionDraftProxy` as its `draft` speculator: one companion call
per round carries the tokens committed since the last call and every slot's
draft request. The companion's draft KV cache is inspected through the actor
after every round; the last test runs the whole distributed app over HTTP.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from specray.deployments.replica.request import EngineRequest
from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts
from .conftest import CONCURRENT_MAX_TOKENS, ENGINE, concurrent_prompts

pytestmark = [pytest.mark.serve, pytest.mark.model]

SLOTS = 4
MAX_TOKENS = 40


def engine_config(target: str, draft: str | None, cross_vocab: bool = False) -> EngineConfig:
    return EngineConfig(model=target, slots=SLOTS, n_ctx=1024 * SLOTS, exact=True, calibrate=False,
                        chain=ChainConfig(speculators=[], policy="first", n_max=8),
                        draft=DraftModelConfig(model=draft, cross_vocab=cross_vocab))


def start_companion(ecfg: EngineConfig):
    """A supervised companion actor and the router's client to it."""
    import ray

    from specray.deployments.actors.supervisor import ActorSupervisor
    from specray.deployments.actors.companion import CompanionActor
    from specray.deployments.actors.companion_client import CompanionClient

    tag = uuid.uuid4().hex[:6]

    def create(gen: int):
        name = f"draft-test-{tag}-{gen}"
        return CompanionActor.options(num_cpus=0.1, name=name, namespace="specray-tests").remote(
            ecfg.model_dump()), name

    def ready(handle, name: str) -> dict:
        return ray.get(handle.info.remote(), timeout=600) | {"actor_name": name}

    sup = ActorSupervisor("companion", create, ready, max_attempts=2)
    sup.start()
    return CompanionClient(sup, timeout_s=300)


def attach(eng, client, ecfg: EngineConfig):
    """Make the engine's chain use the companion for `draft` (as the router does in distributed mode)."""
    from specray.deployments.actors.companion import companion_speculator_factory

    eng.chain = Chain(eng.config.chain, companion_speculator_factory(client, ecfg))
    eng.scheduler.use_policy(eng.scheduler.policy.for_chain(eng.chain))
    return eng.chain.speculator("draft")


def run_checked(eng, client, proxy, prompts, target_model, draft_bos_prefix: int, cross: bool):
    import ray

    reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=("draft",))
            for p in prompts]
    seqs = [eng.submit(r) for r in reqs]
    rounds = checked = synced = 0
    while eng.scheduler.has_work():
        eng.step()
        rounds += 1
        live = {slot: s for slot, s in eng.scheduler.active.items() if s.state == SeqState.DECODING}
        if not live:
            continue
        assert proxy.flush()
        sync = rounds % 3 == 0
        pos = ray.get(client.sup.handle.positions.remote(list(live), sync))
        for slot, seq in live.items():
            if slot not in pos:
                continue
            p = pos[slot]
            committed = seq.history_view()[: seq.n_past].tolist()
            assert p["committed"] == committed  # the companion mirrors exactly what the target committed
            assert eng.ctx.seq_pos_max(slot) + 1 == seq.n_past
            assert p["pos_max"] + 1 == len(p["kv_tokens"])
            if not cross:
                assert p["kv_tokens"] == committed[: len(p["kv_tokens"])]  # no rejected token stays
                if sync:  # KV positions: the companion's cache ends where the target's does
                    assert p["pos_max"] == eng.ctx.seq_pos_max(slot)
                    synced += 1
            elif sync:
                text_t = b"".join(target_model.token_to_piece(t, True) for t in committed
                                  if t != target_model.bos)
                assert len(p["kv_tokens"]) > draft_bos_prefix and len(text_t) > 0
                synced += 1
            checked += 1
    assert checked > 0 and synced > 0
    return seqs, rounds


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(8)


def baseline(target_model, target: str, prompts):
    from specray.deployments.local_engine import LocalEngine

    eng = LocalEngine(engine_config(target, None), model=target_model)
    reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=())
            for p in prompts]
    out = [s.generated for s in eng.run(reqs)]
    return eng, out


def check_lossless(eng, seqs, base, client, proxy, rounds):
    import ray

    assert eng.runner.max_seqs_in_decode >= SLOTS
    for i, s in enumerate(seqs):
        assert s.generated == base[i], f"prompt {i} diverged"
    drafted = sum(s.spec_by_name["draft"].drafted for s in seqs if "draft" in s.spec_by_name)
    accepted = sum(s.spec_by_name["draft"].accepted for s in seqs if "draft" in s.spec_by_name)
    assert drafted > 0 and accepted > 0
    c = ray.get(client.sup.handle.counters.remote())
    assert c["unsynced"] == 0 and proxy.unsynced == 0 and proxy.failed_calls == 0
    assert c["draft_steps"] > 0
    # at most one drafting call per round, for all slots together (the test's own flushes come on top)
    assert 0 < proxy.draft_calls <= rounds
    return drafted, accepted, c


def test_companion_same_vocab_lossless_and_kv_positions(ray_serve, smollm2, prompts):
    eng, base = baseline(smollm2, "smollm2-135m", prompts)
    ecfg = engine_config("smollm2-135m", "smollm2-135m")
    client = start_companion(ecfg)
    try:
        proxy = attach(eng, client, ecfg)
        seqs, rounds = run_checked(eng, client, proxy, prompts, smollm2, 0, cross=False)
        drafted, accepted, c = check_lossless(eng, seqs, base, client, proxy, rounds)
        assert accepted < drafted  # fast-mode draft vs exact target: some drafts are rejected
        assert c["draft_rolled_back"] > 0
        print(f"\ncompanion same-vocab: {accepted}/{drafted} accepted, proxy {proxy.counters()}, companion {c}")
    finally:
        client.sup.close()
        eng.close()


def test_companion_cross_vocab_smollm2_for_gemma_lossless(ray_serve, gemma3, prompts):
    eng, base = baseline(gemma3, "gemma3-270m", prompts)
    ecfg = engine_config("gemma3-270m", "smollm2-135m", cross_vocab=True)
    client = start_companion(ecfg)
    try:
        assert client.sup.info["draft"]["mode"] == "cross_vocab"
        proxy = attach(eng, client, ecfg)
        seqs, rounds = run_checked(eng, client, proxy, prompts, gemma3, 0, cross=True)
        drafted, accepted, c = check_lossless(eng, seqs, base, client, proxy, rounds)
        print(f"\ncompanion cross-vocab: {accepted}/{drafted} accepted, proxy {proxy.counters()}, companion {c}")
    finally:
        client.sup.close()
        eng.close()


def test_companion_refuses_an_incompatible_pair_without_cross_vocab(ray_serve):
    with pytest.raises(Exception) as e:
        start_companion(engine_config("gemma3-270m", "smollm2-135m"))
    assert "vocab_type" in str(e.value)


def test_companion_killed_midway_costs_only_drafts(ray_serve, smollm2, prompts):
    """A dead companion: no drafts for the sequences begun on it, output unchanged, new ones draft again."""
    import ray

    eng, base = baseline(smollm2, "smollm2-135m", prompts[:4])
    ecfg = engine_config("smollm2-135m", "smollm2-135m")
    client = start_companion(ecfg)
    try:
        proxy = attach(eng, client, ecfg)
        reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=("draft",))
                for p in prompts[:4]]
        seqs = [eng.submit(r) for r in reqs]
        for _ in range(4):
            eng.step()
        ray.kill(client.sup.handle, no_restart=True)
        while eng.scheduler.has_work():
            eng.step()
        assert [s.generated for s in seqs] == base
        assert proxy.failed_calls >= 1 or client.skipped >= 1
        assert client.sup.wait_up(300) and client.epoch == 2
        again = eng.run([eng.request(messages=[{"role": "user", "content": prompts[0]}], max_tokens=MAX_TOKENS,
                                     chain=("draft",))])
        assert again[0].generated == base[0] and again[0].spec_by_name["draft"].accepted > 0
    finally:
        client.sup.close()
        eng.close()


def test_distributed_app_drafts_in_the_companion_over_http(ray_serve, reference):
    """The whole app (router replica + target + companion actors): greedy text as the in-process engine."""
    from ray import serve

    from specray.deployments.app import build_app

    # a quantised K cache in the companion's draft context: still lossless (the draft only proposes)
    engine = ENGINE | {"draft": {"model": "smollm2-135m", "cache_type_k": "q8_0", "threads_batch": 1},
                       "chain": {"speculators": ["draft"], "policy": "first", "n_max": 8}}
    args = {"mode": "distributed", "engine": engine, "replica_cpus": 0.2, "target_cpus": 0.4,
            "companion_cpus": 0.1, "ingress_cpus": 0.1, "app_name": "specray-draft", "route_prefix": "/draft"}
    t0 = time.perf_counter()
    serve.run(build_app(args), name="specray-draft", route_prefix="/draft")
    print(f"\ndraft app deployed in {time.perf_counter() - t0:.1f}s")
    try:
        base = f"{ray_serve}/draft"
        prompts = concurrent_prompts()[:SLOTS]
        import concurrent.futures as cf

        def ask(p):
            with httpx.Client(base_url=base, timeout=600) as c:
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": p}],
                                                         "max_tokens": CONCURRENT_MAX_TOKENS, "temperature": 0})
                r.raise_for_status()
                return r.json()

        with cf.ThreadPoolExecutor(SLOTS) as ex:
            outs = list(ex.map(ask, prompts))
        for p, o in zip(prompts, outs):
            text, n, finish = reference[("chat", p, CONCURRENT_MAX_TOKENS)]
            assert o["choices"][0]["message"]["content"] == text
            assert o["usage"]["completion_tokens"] == n
        spec = [o["speculative"] for o in outs]
        assert sum(s["drafts"] for s in spec) > 0 and sum(s["accepted_tokens"] for s in spec) > 0
        assert all(set(s["by_speculator"]) <= {"draft"} for s in spec)
        with httpx.Client(base_url=base, timeout=60) as c:
            st = c.get("/v1/stats").json()
        comp = st["companion"]
        assert comp["calls"] > 0 and comp["draft_steps"] > 0 and comp["unsynced"] == 0
        # the draft's settings as the companion loaded them, beside the target's placement
        draft = st["placement"]["companion"]["draft"]
        assert (draft["cache_type_k"], draft["cache_type_v"], draft["threads_batch"]) == ("q8_0", "f16", 1)
    finally:
        serve.delete("specray-draft")


def test_colocated_router_drafts_in_process(smollm2):
    """RouterCore in co-located mode: the draft model lives in the router's process (no Ray)."""
    import asyncio

    from specray.deployments.local_engine import LocalEngine
    from specray.deployments.replica.core import RouterCore, next_chunk
    from specray.deployments.replica.stream_items import StreamEnd
    from specray.deployments.config import ServeConfig

    engine = {"model": "smollm2-135m", "n_ctx": 1024, "slots": 2, "exact": True, "calibrate": False,
              "draft": {"model": "smollm2-135m", "cache_type_v": "q8_0"},
              "chain": {"speculators": ["draft"], "policy": "first"}}
    prompt = spec_bench_prompts(1)[0]
    ref = LocalEngine(EngineConfig.model_validate(engine | {"draft": {}, "chain": {"speculators": []}}),
                      model=smollm2)
    want = ref.generate(messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS).text
    ref.close()
    core = RouterCore(ServeConfig.model_validate({"mode": "colocated", "engine": engine}))
    try:
        assert core.draft_model is not None and core.draft_model.mode == "same_vocab"

        async def main():
            req = core.make_request(EngineRequest(messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS))
            seq, q = await core.submit(req)
            parts = []
            while True:
                text, term = await next_chunk(q)
                parts.append(text)
                if term:
                    return "".join(parts), term

        text, term = asyncio.run(main())
        assert type(term) is StreamEnd and text == want
        spec = term.speculative
        assert spec["by_speculator"]["draft"]["accepted_tokens"] > 0
        # /v1/stats: the in-process draft's settings (a quantised V cache turned its flash attention on)
        draft = core.stats()["draft"]
        assert (draft["where"], draft["cache_type_v"], draft["flash_attn"]) == ("in-process", "q8_0", True)
    finally:
        core.close()


def test_companion_drafts_carry_runner_ups_into_draft_trees(ray_serve, smollm2, prompts):
    """Fast mode with trees on: the companion's answer carries each draft's runner-ups (the draft model's second
    choices), the router's proxy offers them as branches, and the output is target-only output up to measured
    near-ties. The draft is a 20-layer copy of SmolLM2, often wrong, so its runner-ups sometimes win."""
    from specray.bench.run import classify_divergence, measure_batch_variance, measure_layout_variance
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.cost import DecodeCostModel
    from specray.engine.policy.host_cost import HostCostModel
    from specray.native.draft_truncate import truncated_copy

    draft = truncated_copy("smollm2-135m", list(range(10)) + list(range(20, 30)))
    ecfg = EngineConfig(model="smollm2-135m", slots=2, n_ctx=2048, calibrate=False, record_margins=True,
                        draft=DraftModelConfig(model=draft),
                        chain=ChainConfig(speculators=[], n_max=8, trees=True, model_explore=0.5))
    eng = LocalEngine(ecfg, model=smollm2)
    assert eng.scheduler.memory.tree_seqs > 0
    prefix = eng.prompt_tokens(messages=[{"role": "user", "content": prompts[0]}])
    tie_bound = 2.0 * max(measure_batch_variance(eng, prefix), measure_layout_variance(eng, prefix))
    reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=()) for p in prompts]
    base = eng.run(reqs)
    client = start_companion(ecfg)
    try:
        proxy = attach(eng, client, ecfg)
        assert proxy.offers_branches
        eng.scheduler.cost = DecodeCostModel({1: 0.010, 64: 0.0105}, learn=False)  # verify rows nearly free
        eng.scheduler.policy.pricer.host = HostCostModel(learn=False)
        eng.scheduler.policy.trees.gate.LEARN = 1 << 30  # runner-ups always asked for, paying or not
        reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=("draft",))
                for p in prompts]
        seqs = eng.run(reqs)
        kinds = [classify_divergence(b.generated, s.generated, b.margins, tie_bound) for b, s in zip(base, seqs)]
        trees = eng.scheduler.policy.snapshot()["trees"]
        print(f"\ncompanion draft trees: tie bound {tie_bound:.3f}, outcomes {kinds}, trees {trees}")
        assert "mismatch" not in kinds, kinds
        assert eng.runner.tree_items > 0 and trees["by_speculator"]["draft"]["branches"] > 0, trees
        assert proxy.failed_calls == 0 and proxy.unsynced == 0
    finally:
        client.sup.close()
        eng.close()
