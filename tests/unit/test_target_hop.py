"""The compiled target hop's settings and pure parts (no Ray): the config field and its flag, the auto choice,
the wait before a read, and the bench's --target-hops. tests/serve/test_compiled_hop.py runs the graph."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

from specray.bench.http_compare import serve_configs
from specray.cli.main import build_parser, main
from specray.cli.serve import config_from_args
from specray.deployments.actors import target_channel
from specray.deployments.actors.supervisor import is_actor_death
from specray.deployments.config import load_serve_config
from specray.engine.config import EngineConfig


def test_doctests():
    failed, attempted = doctest.testmod(target_channel)
    assert attempted > 0 and failed == 0


def test_the_field_defaults_to_auto_and_compiled_needs_the_distributed_mode():
    assert load_serve_config({}).target_hop == "auto"
    assert load_serve_config({"mode": "distributed", "target_hop": "compiled"}).target_hop == "compiled"
    with pytest.raises(ValidationError, match="needs mode 'distributed'"):
        load_serve_config({"mode": "colocated", "target_hop": "compiled"})
    with pytest.raises(ValidationError, match="target_hop"):
        load_serve_config({"target_hop": "teleport"})


def test_hidden_state_heads_take_the_hop_the_node_gives():
    # the target pins their rows' refs until the companion's ack (row_transport.ObjectStoreTransport), so a
    # compiled graph carries them too (tests/serve/test_hidden_distributed.py runs both hops)
    cfg = load_serve_config({"mode": "distributed", "target_hop": "compiled", "engine": {"hidden": {"mtp": True}}})
    assert cfg.target_hop == "compiled"
    gpu = {"cpus": 16, "threads": 16, "n_gpu_layers": 33, "hidden_transport": {"transport": "cuda_ipc"}}
    assert target_channel.resolve_target_hop("auto", gpu) == "compiled"
    busy = {"cpus": 2, "threads": 2, "n_gpu_layers": 0, "hidden_transport": {"transport": "object_store"}}
    assert target_channel.resolve_target_hop("auto", busy) == "actor"


def test_the_serve_flag_sets_it():
    p = build_parser()
    cfg = config_from_args(p.parse_args(["serve", "--mode", "distributed", "--target-hop", "compiled"]))
    assert cfg.target_hop == "compiled"
    assert config_from_args(p.parse_args(["serve"])).target_hop == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--target-hop", "teleport"])


def test_expected_wait_sleeps_a_share_of_the_shortest_recent_step_of_as_many_rows():
    w = target_channel.ExpectedWait(share=0.5, keep=2)
    w.observe(3, 0.010)
    w.observe(3, 0.004)
    w.observe(3, 0.008)  # the 0.010 falls out of the window; the shortest of the last two is 0.004
    assert w.before(3) == pytest.approx(0.002)
    assert w.before(4) == 0.0


def test_a_compiled_hop_whose_actor_died_or_hung_counts_as_actor_death():
    from ray.exceptions import RayChannelError, RayChannelTimeoutError

    assert is_actor_death(RayChannelError("channel closed"))
    assert is_actor_death(RayChannelTimeoutError("no answer"))
    assert not is_actor_death(ValueError("a bug"))


def test_bench_deploys_one_distributed_app_per_target_hop(capsys):
    cfgs = serve_configs(EngineConfig(), ["distributed"], hops=["auto", "compiled"])
    assert [(c.target_hop, c.route_prefix) for c in cfgs] == [("auto", "/bench-distributed"),
                                                              ("compiled", "/bench-distributed-compiled")]
    # colocated has no target actor: one app whatever the hops
    assert [c.mode for c in serve_configs(EngineConfig(), ["colocated"], hops=["actor", "compiled"])] == ["colocated"]
    rc = main(["bench", "--http", "--serve-modes", "distributed", "--target-hops", "actor,teleport"])
    assert rc != 0 and "--target-hops" in capsys.readouterr().err


def test_a_graph_that_cannot_be_compiled_to_a_new_actor_leaves_the_proxy_on_the_old_one():
    from specray.deployments.actors.target import RemoteTarget

    old = object()
    r = RemoteTarget(old, epoch=1, hop="actor")
    r.mode = "compiled"  # as if the first graph had been compiled; the new actor has no `channel` method
    with pytest.raises(AttributeError):
        r.reset(object(), 2)
    # Faults.sync_target marks the new actor down; the proxy still names the old epoch, so it retries with the next
    assert r.epoch == 1 and r.actor is old and r.channel is None


def test_the_http_bench_serves_the_hidden_state_heads_it_is_given():
    # `bench --http --spec eagle3 --eagle3-model H` used to deploy apps without the head: every replica then
    # failed to start ("speculator 'eagle3' needs an EAGLE-3 draft model")
    from specray.bench.http_compare import engine_config

    args = build_parser().parse_args(["bench", "--http", "--eagle3-model", "head.gguf", "--mtp"])
    hidden = engine_config(args, 4, "eagle3").hidden
    assert hidden.eagle3_model == "head.gguf" and hidden.mtp and not hidden.dflash_model
    assert not engine_config(build_parser().parse_args(["bench", "--http"]), 4, None).hidden.enabled


def test_the_companion_hop_field_flag_and_bench_apps(capsys):
    assert load_serve_config({}).companion_hop == "auto"
    with pytest.raises(ValidationError, match="companion_hop 'compiled' needs mode 'distributed'"):
        load_serve_config({"mode": "colocated", "companion_hop": "compiled"})
    p = build_parser()
    args = p.parse_args(["serve", "--mode", "distributed", "--companion-hop", "compiled"])
    assert config_from_args(args).companion_hop == "compiled"
    assert config_from_args(p.parse_args(["serve"])).companion_hop == "auto"
    cfgs = serve_configs(EngineConfig(), ["distributed"], hops=["compiled"], companion_hops=["actor", "compiled"])
    assert [(c.target_hop, c.companion_hop) for c in cfgs] == [("compiled", "actor"), ("compiled", "compiled")]
    rc = main(["bench", "--http", "--serve-modes", "distributed", "--companion-hops", "teleport"])
    assert rc != 0 and "--companion-hops" in capsys.readouterr().err


def test_the_companion_client_refuses_an_unknown_hop():
    from specray.deployments.actors.companion_client import CompanionClient

    client = CompanionClient(sup=None)
    client.use_hop("compiled")
    assert client.hop == "compiled" and client.hop_stats() == {"mode": "compiled", "compiles": 0}
    with pytest.raises(ValueError, match="companion hop"):
        client.use_hop("teleport")
