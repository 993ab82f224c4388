"""Which deployments a config builds: fused (one arm: the engine replica is the ingress) or split (an Ingress
in front of one engine deployment per arm); the --layout flag. No Ray needed (the app graph only)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specray.cli.main import build_parser
from specray.cli.serve import config_from_args
from specray.deployments.app import build_app, uses_fused
from specray.deployments.config import DEFAULT_LAYOUT, load_serve_config


def _ingress(args: dict):
    """The deployment the HTTP proxy calls (the app's ingress)."""
    return build_app(args)._bound_deployment


def test_one_arm_fused_is_a_single_engine_deployment_serving_http():
    d = _ingress({"layout": "fused", "engine": {"slots": 8}, "retry_after_s": 3})
    assert d.name == "EngineReplica"  # user_config chain updates keep addressing it by the same name
    assert d.func_or_class.__name__ == "FusedReplica"
    config, engine_config, arm, replicas = d.init_args
    assert arm == "default" and replicas == 1 and engine_config["engine"]["slots"] == 8
    assert set(d.user_config) == {"chain", "weights"}
    # the engine's own limits, plus the 503 + Retry-After the Ingress used to give for a full queue
    assert d._deployment_config.max_ongoing_requests == 64
    assert d._deployment_config.backpressure_config.retry_after_s == 3


def test_fixed_replicas_are_fused_and_gather_stats_from_their_peers():
    d = _ingress({"layout": "fused", "num_replicas": 3})
    assert d.func_or_class.__name__ == "FusedReplica" and d._deployment_config.num_replicas == 3
    assert d.init_args[3] == 3  # not solo: /v1/stats broadcasts to the other replicas


def test_autoscaling_keeps_the_split_layout():
    """Records of engine replicas that scale away stay with the Ingress (fused, they would go with them)."""
    for args in ({"autoscaling": {"max_replicas": 3}}, {"arms": [{"name": "a", "autoscaling": {"max_replicas": 3}}]}):
        d = _ingress({"layout": "fused"} | args)
        assert d.name == "Ingress"
        ((eng,),) = (arms.values() for arms in d.init_args[0].values())
        assert eng._bound_deployment._deployment_config.autoscaling_config.max_replicas == 3


def test_one_explicit_arm_is_fused_under_its_arm_name():
    d = _ingress({"layout": "fused", "arms": [{"name": "fast", "chain": "suffix"}]})
    assert d.name == "EngineReplica-fast" and d.init_args[2] == "fast"
    assert d.user_config["chain"]["speculators"] == ["suffix"]


def test_several_arms_build_the_split_layout_whatever_the_layout_says():
    args = {"layout": "fused", "arms": [{"name": "base", "chain": "none"}, {"name": "fast", "chain": "suffix"}]}
    assert not uses_fused(load_serve_config(args))
    d = _ingress(args)
    assert d.name == "Ingress"
    (arms,) = d.init_args[0].values()  # {model: {arm: engine deployment}}
    assert {k: v._bound_deployment.name for k, v in arms.items()} == {
        "base": "EngineReplica-base", "fast": "EngineReplica-fast"}


def test_split_layout_keeps_the_ingress_tier_for_one_arm():
    d = _ingress({"layout": "split", "ingress_replicas": 2})
    assert d.name == "Ingress" and d._deployment_config.num_replicas == 2
    assert {m: {k: v._bound_deployment.name for k, v in arms.items()} for m, arms in d.init_args[0].items()} == {
        "smollm2-135m": {"default": "EngineReplica"}}


def test_layout_default_flag_and_bad_value():
    assert load_serve_config({}).layout == DEFAULT_LAYOUT
    p = build_parser()
    assert config_from_args(p.parse_args(["serve", "--layout", "split"])).layout == "split"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--layout", "sideways"])
    with pytest.raises(ValidationError, match="layout"):
        load_serve_config({"layout": "sideways"})


def test_bench_row_labels_doctest():
    import doctest

    from specray.bench import http_compare

    failed, attempted = doctest.testmod(http_compare)
    assert attempted > 0 and failed == 0


def test_direct_ingress_wants_one_ingress_replica():
    from specray.cli.serve import check_direct_ingress, direct_ingress_env

    check_direct_ingress(load_serve_config({"direct_ingress": True}))  # fused, one replica: fine
    check_direct_ingress(load_serve_config({"direct_ingress": True, "layout": "split"}))
    with pytest.raises(ValueError, match="--direct-ingress.*num_replicas"):
        check_direct_ingress(load_serve_config({"direct_ingress": True, "num_replicas": 2}))
    with pytest.raises(ValueError, match="--direct-ingress.*ingress_replicas"):
        check_direct_ingress(load_serve_config({"direct_ingress": True, "layout": "split", "ingress_replicas": 2}))
    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123", "8124")
    assert config_from_args(build_parser().parse_args(["serve", "--direct-ingress"])).direct_ingress


def test_direct_ingress_is_on_by_default_exactly_where_it_can_be():
    import subprocess
    import sys

    from specray.cli.serve import auto_direct_ingress
    from specray.deployments.layout import several_ingress_replicas

    assert config_from_args(build_parser().parse_args(["serve"])).direct_ingress is None  # auto
    assert config_from_args(build_parser().parse_args(["serve", "--no-direct-ingress"])).direct_ingress is False
    assert several_ingress_replicas(load_serve_config({})) is None
    assert "num_replicas" in several_ingress_replicas(load_serve_config({"num_replicas": 2}))
    assert several_ingress_replicas(load_serve_config({"autoscaling": {"min_replicas": 1, "max_replicas": 3}})) \
        is None  # autoscaling runs split, whose one ingress replica takes the port
    assert auto_direct_ingress(True, False, None)[0]
    assert not auto_direct_ingress(False, False, None)[0]  # a joined cluster: its Serve is already configured
    assert not auto_direct_ingress(True, True, None)[0]  # Serve imported: it has read its flags already
    assert not auto_direct_ingress(True, False, "ingress_replicas")[0]
    # deciding it must not import Serve (Serve reads the direct-ingress setting at import)
    code = ("import sys; from specray.deployments.layout import several_ingress_replicas; "
            "from specray.deployments.config import load_serve_config; several_ingress_replicas(load_serve_config({})); "
            "print('ray.serve' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"
