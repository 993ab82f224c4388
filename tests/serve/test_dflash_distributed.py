"""The `dflash` speculator across Ray actors: target actor -> row transport -> companion actor.

As tests/serve/test_hidden_distributed.py does for mtp / eagle3: the router's
scheduler in this process, the real target actor behind `RemoteTarget`, the
real companion actor behind the router's `dflash` proxy (one call per drafting
round). After every round the rows the companion received are compared,
position by position, with the target's rows for each sequence decoded alone,
and the companion's window must end where the sequence's committed tokens do.
Both transports that run without a GPU: object_store (only references pass
through the router) and inline (the rows by value). The synthetic draft has
random weights: its blocks are (almost) never accepted; the output must be
the target's own.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig

from ..conftest import spec_bench_prompts
from ..hidden_models import dflash_draft, solo_rows
from .test_hidden_distributed import Distributed, baseline, requests, run_routed

pytestmark = [pytest.mark.serve, pytest.mark.model]

LAYERS = (1, 15, 27)


def engine_config(slots: int, transport: str, kind: str = "dflash") -> EngineConfig:
    return EngineConfig(model="smollm2-135m", slots=slots, n_ctx=512 * slots, exact=True, calibrate=False,
                        chain=ChainConfig(speculators=[], policy="first", n_max=8,
                                          params={"dflash": {"n_max": 6, "audit": True}}),
                        hidden=HiddenStateConfig(dflash_model=dflash_draft(kind), transport=transport,
                                                 inline_below_bytes=0))  # every record by its transport


@pytest.mark.parametrize("transport,slots,kind", [("object_store", 4, "dflash"), ("inline", 1, "dflash"),
                                                  ("inline", 4, "dflash2")])
def test_dflash_distributed_lossless_rows_and_window(ray_serve, smollm2, transport, slots, kind):
    import ray

    from specray.deployments.actors.companion_hidden import CompanionDFlashProxy
    from specray.deployments.actors.row_transport import ObjectStoreHandle
    from specray.engine.hidden_rows import HiddenRows

    cfg = engine_config(slots, transport, kind)
    d = Distributed(cfg)
    try:
        assert d.client.sup.info["speculators"] == ["dflash"]
        info = d.client.sup.info["hidden"]["dflash"]
        assert info["block_size"] == 8 and info["selector_top_k"] == (4 if kind == "dflash2" else 0)
        assert d.target_info["hidden_transport"]["transport"] == transport
        proxy = d.chain.speculator("dflash")
        assert isinstance(proxy, CompanionDFlashProxy) and proxy.max_steps == 6
        reqs = requests(d.vocab, spec_bench_prompts(4), ("dflash",), 12)
        base = baseline(cfg, reqs, model=smollm2)
        solo = solo_rows(smollm2, LAYERS, [np.concatenate([r.prompt_tokens, b]) for r, b in zip(reqs, base)],
                         n_ctx=512 * slots, slots=slots)
        seqs, checked = run_routed(d, "dflash", reqs, solo, positions="some")
        assert checked > 0 and [s.generated for s in seqs] == base
        handle = ObjectStoreHandle if transport == "object_store" else HiddenRows
        assert d.handles and all(isinstance(h, handle) for h in d.handles)
        assert proxy.flush()
        c = ray.get(d.client.sup.handle.counters.remote())
        t = ray.get(d.target.counters.remote())["hidden_transport"]
        assert t["exported"] == len(d.handles) == c["hidden_transport_opened"]
        assert c["hidden_transport_opened_bytes"] == t["exported_bytes"]
        assert c["dflash_mismatched"] == c["dflash_unsynced"] == c["dflash_lost"] == c["dflash_failures"] == 0
        assert c["dflash_blocks"] > 0 and c["dflash_drafted_tokens"] > 0 and c["dflash_injected_rows"] > 0
        assert c["dflash_blocks"] <= proxy.draft_calls  # one block decode per drafting call, all slots in it
        # a sequence still in a slot: the window's cells are exactly its committed positions that were drafted on
        state = ray.get(d.client.sup.handle.hidden_state.remote("dflash", list(range(slots))))
        for st in state.values():
            w = st["window"]
            assert w["lo"] == 0 and w["injected"] <= w["end"] == len(st["committed"])
            assert st["pos_max"] == w["injected"] - 1
        acc = sum(s.spec_by_name["dflash"].accepted for s in seqs)
        drafted = sum(s.spec_by_name["dflash"].drafted for s in seqs)
        print(f"\n{kind} distributed ({transport}, {slots} slots): {acc}/{drafted} accepted (random draft), "
              f"{len(d.handles)} records, {c['hidden_transport_opened_bytes']} bytes")
    finally:
        d.close()


def test_dflash_companion_killed_mid_run_degrades_to_plain_decoding(ray_serve, smollm2):
    """The companion dies after a few drafting rounds: those calls give no drafts, the supervisor brings up a new
    one (new epoch: the running sequences draft nothing more there), and the output is still the target's."""
    import ray

    cfg = engine_config(2, "object_store")
    d = Distributed(cfg)
    try:
        proxy = d.chain.speculator("dflash")
        reqs = requests(d.vocab, spec_bench_prompts(2), ("dflash",), 16)
        base = baseline(cfg, reqs, model=smollm2)
        seqs = [d.scheduler.submit(r) for r in reqs]
        epoch = d.client.epoch
        while d.scheduler.has_work() and proxy.draft_calls < 3:
            d.scheduler.step()
        assert proxy.draft_calls >= 3 and proxy.failed_calls == 0
        ray.kill(d.client.sup.handle)
        while d.scheduler.has_work():
            d.scheduler.step()
        assert [s.generated for s in seqs] == base
        assert proxy.failed_calls >= 1 or d.client.skipped >= 1
        assert d.client.sup.wait_up(300) and d.client.epoch > epoch
    finally:
        d.close()
