"""ServeConfig, the app builder's options and `specray serve` flag handling (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from specray.deployments.app import USER_CODE_THREAD_ENV, build_app, replica_options
from specray.cli.main import build_parser
from specray.cli.serve import config_from_args, url_of
from specray.deployments.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parents[2]
LOCAL_YAML = REPO / "cluster" / "serve-local.yaml"


def test_serve_local_yaml_is_a_valid_serve_config_with_our_app_args():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(LOCAL_YAML.read_text())
    schema = ServeDeploySchema.model_validate(doc)
    app = schema.applications[0]
    assert app.import_path == "specray.deployments.app:build_app"
    cfg = load_serve_config(app.args)
    assert cfg.engine.model == "smollm2-135m" and cfg.mode in ("colocated", "distributed")
    build_app(app.args)  # the builder accepts them (Serve calls it the same way)
    # `specray serve --config cluster/serve-local.yaml` reads the same file
    same = ServeConfig.from_yaml(LOCAL_YAML)
    assert same.engine == cfg.engine and same.port == doc["http_options"]["port"]


def test_yaml_file_plus_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("mode: distributed\nengine:\n  slots: 6\n  chain: {speculators: suffix, n_max: 4}\nport: 9001\n")
    cfg = load_serve_config({"config_file": str(f), "engine": {"n_ctx": 2048}})
    assert cfg.mode == "distributed" and cfg.port == 9001
    assert cfg.engine.slots == 6 and cfg.engine.n_ctx == 2048  # nested keys merged, not replaced
    assert cfg.engine.chain.speculators == ["suffix"] and cfg.engine.chain.n_max == 4
    assert ServeConfig.from_yaml(f).engine.n_ctx == 4096


def test_unknown_keys_are_errors(tmp_path):
    with pytest.raises(ValidationError):
        load_serve_config({"engine": {"slotz": 4}})
    with pytest.raises(ValidationError):
        load_serve_config({"mode": "sideways"})


def test_distributed_replica_gets_a_strict_pack_group_of_three_bundles():
    cfg = load_serve_config({"mode": "distributed", "replica_cpus": 0.2, "target_cpus": 0.5, "companion_cpus": 0.1})
    opts = replica_options(cfg)
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 0.2}, {"CPU": 0.5}, {"CPU": 0.1}]
    assert opts["ray_actor_options"]["num_cpus"] == 0.2  # a subset of bundle 0
    # by default only Serve's user-code loop switch (user_code_loop: shared); no worker_env
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {USER_CODE_THREAD_ENV: "0"}}
    env = replica_options(load_serve_config({"mode": "distributed", "worker_env": {"OMP_WAIT_POLICY": "passive"}}))
    assert env["ray_actor_options"]["runtime_env"] == {"env_vars": {USER_CODE_THREAD_ENV: "0",
                                                                    "OMP_WAIT_POLICY": "passive"}}
    sep = replica_options(load_serve_config({"user_code_loop": "separate",
                                             "worker_env": {USER_CODE_THREAD_ENV: "0"}}))
    assert sep["ray_actor_options"]["runtime_env"] == {"env_vars": {USER_CODE_THREAD_ENV: "0"}}  # worker_env wins


def test_serving_env_doctest():
    import doctest

    from specray.deployments import app

    failed, attempted = doctest.testmod(app)
    assert attempted > 0 and failed == 0
    colo = replica_options(load_serve_config({"mode": "colocated"}))
    assert "placement_group_bundles" not in colo
    auto = replica_options(load_serve_config({"autoscaling": {"min_replicas": 1, "max_replicas": 3}}))
    # the LLM default signal is filled in: ongoing requests per replica against its slots (engine.slots = 4)
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    assert "num_replicas" not in auto


def test_cli_flags_override_the_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 9002\nmode: distributed\nengine: {slots: 6, threads: 1}\n")
    p = build_parser()
    cfg = config_from_args(p.parse_args(["serve", "--config", str(f), "--slots", "3", "--spec", "none"]))
    assert cfg.port == 9002 and cfg.mode == "distributed"  # flags left at their defaults don't override
    assert cfg.engine.slots == 3 and cfg.engine.threads == 1 and cfg.engine.chain.speculators == []
    cfg = config_from_args(p.parse_args(["serve", "--port", "8100", "--mode", "distributed", "--exact"]))
    assert cfg.port == 8100 and cfg.mode == "distributed" and cfg.engine.exact
    d = config_from_args(p.parse_args(["serve"]))
    assert (d.host, d.port, d.engine.model, d.engine.chain.label) == ("127.0.0.1", 8000, "smollm2-135m",
                                                                      "ngram_mod,suffix,ngram_cache,grammar")
    assert url_of(d) == "http://127.0.0.1:8000"


def test_the_gpu_config_places_one_replica_per_gpu():
    doc = yaml.safe_load((REPO / "cluster" / "serve-gpu.yaml").read_text())
    cfg = load_serve_config(doc["applications"][0]["args"])
    assert cfg.mode == "distributed" and cfg.engine.n_gpu_layers is None  # every layer where a GPU is seen
    opts = replica_options(cfg)
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    replica, target, companion = opts["placement_group_bundles"]
    assert target == {"CPU": 4.0, "GPU": 1.0} and "GPU" not in replica and "GPU" not in companion
    assert opts["autoscaling_config"]["min_replicas"] == 1 and opts["autoscaling_config"]["max_replicas"] >= 1
