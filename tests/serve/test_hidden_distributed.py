"""Hidden-state speculators across Ray actors: target actor -> object store -> companion actor.

The router side is the round scheduler in this process with the real target
actor behind `RemoteTarget` (one step call per round) and the real companion
actor behind the `mtp` / `eagle3` proxies (one call per drafting round). The
target `ray.put`s each round's rows; only references pass through the router.
After every round the rows the companion received are compared, sequence by
sequence and position by position, with the target's rows for each sequence
decoded alone. The last test runs the whole distributed app over HTTP with
the official openai client.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import openai
import pytest

from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig
from specray.engine.request import GenerationRequest, SeqState
from specray.engine.sampling import SamplingParams

from specray.deployments.actors.companion_hidden import FLUSH_RECORDS

from ..conftest import spec_bench_prompts
from ..hidden_models import eagle3_draft, mtp_target, solo_rows

pytestmark = [pytest.mark.serve, pytest.mark.model]

SLOTS = 4
N_CTX = 512 * SLOTS


def engine_config(model: str, name: str, **hidden) -> EngineConfig:
    return EngineConfig(model=model, slots=SLOTS, n_ctx=N_CTX, exact=True, calibrate=False,
                        chain=ChainConfig(speculators=[], policy="first", n_max=8,
                                          params={name: {"n_max": 4, "audit": True}}),
                        hidden=HiddenStateConfig(**hidden))


class Distributed:
    """Target actor + supervised companion actor + the router's scheduler, built as RouterCore builds them
    (actors.launch.start_actors, builder.build_engine)."""

    def __init__(self, cfg: EngineConfig, target_hop: str = "actor", companion_hop: str = "actor") -> None:
        from specray.deployments.actors.launch import start_actors
        from specray.deployments.builder import build_engine
        from specray.deployments.config import ServeConfig

        serve_cfg = ServeConfig(mode="distributed", engine=cfg, target_cpus=0.4, companion_cpus=0.1,
                                actor_restart_attempts=2, actor_start_timeout_s=600, companion_call_timeout_s=300)
        self.actors = start_actors(serve_cfg, tag=f"hidden-test-{uuid.uuid4().hex[:6]}")
        parts = build_engine(cfg, actors=self.actors, target_hop=target_hop, companion_hop=companion_hop)
        self.target, self.target_info = self.actors.target.handle, self.actors.target.info
        self.client, self.remote, self.vocab = self.actors.companion, parts.remote, parts.model
        self.chain, self.scheduler = parts.chain, parts.scheduler
        self.handles: list = []  # what reached the router for each round's rows
        deliver = self.chain.hidden
        self.chain.hidden = lambda h: (self.handles.append(h), deliver(h))

    def close(self) -> None:
        self.remote.close()  # a compiled graph goes before its actor (RouterCore.close's order)
        self.actors.close()


def requests(vocab, prompts, chain, max_tokens):
    return [GenerationRequest(prompt_tokens=vocab.chat_tokens([{"role": "user", "content": p}]),
                              max_tokens=max_tokens, sampling=SamplingParams(), chain=chain, ignore_eos=True)
            for p in prompts]


def baseline(cfg: EngineConfig, reqs, model=None) -> list[list[int]]:
    from specray.deployments.local_engine import LocalEngine

    eng = LocalEngine(cfg.model_copy(update={"hidden": HiddenStateConfig()}), model=model)
    out = [s.generated for s in eng.run([GenerationRequest(prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens,
                                                           sampling=SamplingParams(), chain=(), ignore_eos=True)
                                         for r in reqs])]
    eng.close()
    return out


def run_routed(d: Distributed, name: str, reqs, solo, positions: str = "all") -> int:
    """Run to completion; after every round check the companion's rows against `solo`. Returns rows checked."""
    import ray

    proxy = d.chain.speculator(name)
    seqs = [d.scheduler.submit(r) for r in reqs]
    index = {s.id: i for i, s in enumerate(seqs)}
    checked = 0
    while d.scheduler.has_work():
        d.scheduler.step()
        live = {slot: s for slot, s in d.scheduler.active.items() if s.state == SeqState.DECODING}
        if not live:
            continue
        assert proxy.flush()
        state = ray.get(d.client.sup.handle.hidden_state.remote(name, list(live)))
        for slot, seq in live.items():
            st, hist, want = state[slot], seq.history_view()[: seq.n_past], solo[index[seq.id]]
            assert not st["lost"] and st["committed"].tolist() == hist.tolist()
            assert sorted(st["audit"]) == list(range(seq.n_past))
            pick = range(seq.n_past) if positions == "all" else (0, seq.n_past // 2, seq.n_past - 1)
            for pos in pick:
                tok, row = st["audit"][pos]
                assert tok == hist[pos] and np.array_equal(row, want[pos]), f"slot {slot} position {pos}"
                checked += 1
    return seqs, checked


def check_transport(d: Distributed, name: str) -> dict:
    import ray

    from specray.deployments.actors.row_transport import ObjectStoreHandle

    assert d.handles and all(isinstance(h, ObjectStoreHandle) for h in d.handles)  # refs only, never rows
    assert d.chain.speculator(name).flush()  # the last rounds' events wait for the next call: send them
    c = ray.get(d.client.sup.handle.counters.remote())
    t = ray.get(d.target.counters.remote())["hidden_transport"]
    assert t["transport"] == "object_store" and t["exported"] == len(d.handles)
    assert c["hidden_transport_opened"] == t["exported"] and c["hidden_transport_opened_bytes"] == t["exported_bytes"]
    assert c[f"{name}_mismatched"] == c[f"{name}_unsynced"] == c[f"{name}_lost"] == c[f"{name}_failures"] == 0
    assert c["hidden_unsynced"] == 0
    # every ref stayed pinned on the target until read; the acks of the last flush are still with the router
    assert t["unpinned_early"] == 0 and t["pinned"] <= FLUSH_RECORDS
    return c


@pytest.mark.parametrize("hop", ["actor", "compiled"])
def test_mtp_distributed_object_store_lossless_and_routed(ray_serve, hop):
    cfg = engine_config(mtp_target("noisy"), "mtp", mtp=True, transport="object_store",
                        inline_below_bytes=0)
    d = Distributed(cfg, target_hop=hop)
    try:
        assert d.remote.mode == hop
        assert d.client.sup.info["speculators"] == ["mtp"]
        assert d.target_info["hidden_transport"]["transport"] == "object_store"
        reqs = requests(d.vocab, spec_bench_prompts(6), ("mtp",), 32)
        base = baseline(cfg, reqs)
        from specray.native.model import Model

        target = Model(cfg.model, use_extra_bufts=False)
        solo = solo_rows(target, ("nextn",), [np.concatenate([r.prompt_tokens, b]) for r, b in zip(reqs, base)],
                         n_ctx=N_CTX, slots=SLOTS)
        seqs, checked = run_routed(d, "mtp", reqs, solo)
        assert checked > 0
        assert [s.generated for s in seqs] == base
        acc = sum(s.spec_by_name["mtp"].accepted for s in seqs)
        drafted = sum(s.spec_by_name["mtp"].drafted for s in seqs)
        assert 0 < acc < drafted  # accepted and rejected rounds
        c = check_transport(d, "mtp")
        print(f"\nmtp distributed: {acc}/{drafted} accepted, {len(d.handles)} records, "
              f"{c['hidden_transport_opened_bytes']} bytes, put {1000 * c['hidden_transport_export_seconds']:.1f} ms, "
              f"get {1000 * c['hidden_transport_open_seconds']:.1f} ms in all")
        target.close()
    finally:
        d.close()


@pytest.mark.parametrize("companion_hop", ["actor", "compiled"])
def test_rows_by_value_and_flushes_behind_through_compiled_hops(ray_serve, monkeypatch, companion_hop):
    """Small rounds' rows go by value (inline_below_bytes' default); through a compiled graph they arrive as views
    of the channel's buffer, which the proxy kept until its next companion call: the channel then could not take
    the next step's answer, and every round timed out. Run without the per-round inspection (which flushes
    synchronously). A flush after every record (FLUSH_RECORDS 1) goes without waiting, between the rounds'
    draft calls: its answer must be read in order, through either companion hop."""
    import ray

    from specray.deployments.actors import companion_hidden
    from specray.engine.hidden_rows import HiddenRows

    monkeypatch.setattr(companion_hidden, "FLUSH_RECORDS", 1)
    cfg = engine_config(mtp_target("noisy"), "mtp", mtp=True, transport="object_store", flush_behind=True)
    assert cfg.hidden.inline_below_bytes > 0  # the default
    d = Distributed(cfg, target_hop="compiled", companion_hop=companion_hop)
    try:
        assert d.client.hop == companion_hop and d.chain.speculator("mtp").flush_behind
        reqs = requests(d.vocab, spec_bench_prompts(4), ("mtp",), 32)
        base = baseline(cfg, reqs)
        seqs = [d.scheduler.submit(r) for r in reqs]
        rounds = 0
        while d.scheduler.has_work():
            d.scheduler.step()
            rounds += 1
        assert [s.generated for s in seqs] == base
        assert sum(s.spec_by_name["mtp"].accepted for s in seqs) > 0
        assert rounds > 2 and d.handles and all(isinstance(h, HiddenRows) for h in d.handles)
        proxy = d.chain.speculator("mtp")
        assert proxy.flushes > 0 and proxy.failed_calls == 0 and proxy.flush()
        c = ray.get(d.client.sup.handle.counters.remote())
        assert c["hidden_transport_opened"] == len(d.handles)  # every record reached the companion, in order
        assert c["mtp_mismatched"] == c["mtp_unsynced"] == c["mtp_lost"] == c["hidden_unsynced"] == 0
    finally:
        d.close()


def test_eagle3_distributed_object_store_lossless(ray_serve, smollm2):
    cfg = engine_config("smollm2-135m", "eagle3", eagle3_model=eagle3_draft(), transport="object_store",
                        inline_below_bytes=0)
    d = Distributed(cfg)
    try:
        assert d.client.sup.info["speculators"] == ["eagle3"]
        reqs = requests(d.vocab, spec_bench_prompts(4), ("eagle3",), 12)
        base = baseline(cfg, reqs, model=smollm2)
        solo = solo_rows(smollm2, (2, 15, 27), [np.concatenate([r.prompt_tokens, b]) for r, b in zip(reqs, base)],
                         n_ctx=N_CTX, slots=SLOTS)
        seqs, checked = run_routed(d, "eagle3", reqs, solo, positions="some")
        assert checked > 0 and [s.generated for s in seqs] == base
        c = check_transport(d, "eagle3")
        assert c["eagle3_steps"] > 0 and c["eagle3_drafted_tokens"] > 0
    finally:
        d.close()


@pytest.mark.parametrize("hop", ["actor", "compiled"])
def test_mtp_app_over_http_forced_acceptance(ray_serve, hop):
    """The whole distributed app, --mtp with a head that copies the target's block, through actor calls or
    compiled graphs to both actors:
    same text as in-process, and the response's speculative block shows the drafts were used."""
    from ray import serve

    from specray.deployments.app import build_app
    from specray.deployments.local_engine import LocalEngine

    path = mtp_target("copy")
    engine = {"model": path, "n_ctx": N_CTX, "slots": SLOTS, "threads": 2, "exact": True, "calibrate": False,
              "hidden": {"mtp": True}, "chain": {"speculators": ["mtp"], "policy": "first", "n_max": 4}}
    prompts = spec_bench_prompts(SLOTS)
    ref = LocalEngine(EngineConfig.model_validate(engine | {"hidden": {}, "chain": {"speculators": []}}))
    want = [ref.generate(messages=[{"role": "user", "content": p}], max_tokens=24).text for p in prompts]
    ref.close()
    args = {"mode": "distributed", "engine": engine, "replica_cpus": 0.2, "target_cpus": 0.4, "companion_cpus": 0.1,
            "ingress_cpus": 0.1, "app_name": "specray-mtp", "route_prefix": "/mtp", "target_hop": hop,
            "companion_hop": hop}
    t0 = time.perf_counter()
    serve.run(build_app(args), name="specray-mtp", route_prefix="/mtp")
    print(f"\nmtp app deployed in {time.perf_counter() - t0:.1f}s")
    try:
        client = openai.OpenAI(base_url=f"{ray_serve}/mtp/v1", api_key="none", timeout=300, max_retries=0)
        import concurrent.futures as cf

        def ask(p):
            return client.chat.completions.create(model="x", messages=[{"role": "user", "content": p}],
                                                  max_tokens=24, temperature=0)

        with cf.ThreadPoolExecutor(SLOTS) as ex:
            outs = list(ex.map(ask, prompts))
        assert [o.choices[0].message.content for o in outs] == want
        spec = [o.model_extra["speculative"]["by_speculator"]["mtp"] for o in outs]
        assert sum(s["accepted_tokens"] for s in spec) > 0.9 * sum(s["drafted_tokens"] for s in spec) > 0
        import httpx

        st = httpx.get(f"{ray_serve}/mtp/v1/stats", timeout=60).json()
        assert st["hop"]["mode"] == st["companion"]["hop"]["mode"] == hop
        assert st["companion"]["decode_threads"] == 1  # the head's probes at start and every round: one thread
        assert st["companion"]["mtp_mismatched"] == 0 and st["companion"]["hidden_transport_opened"] > 0
        # every record the target exported reached the companion, but for the last rounds' (they wait in the
        # proxy for its next call; at most FLUSH_RECORDS)
        exported, opened = st["target"]["hidden_transport"]["exported"], st["companion"]["hidden_transport_opened"]
        assert exported - FLUSH_RECORDS <= opened <= exported
    finally:
        serve.delete("specray-mtp")
