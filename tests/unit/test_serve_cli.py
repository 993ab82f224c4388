"""`specray serve` flags vs --config: a flag given always wins, a flag not given never overrides (no Ray)."""

from __future__ import annotations

import pytest

from specray.cli.main import build_parser, main
from specray.cli.serve import config_from_args, flag_overrides
from specray.deployments.config import ServeConfig
from specray.engine.config import EngineConfig

# every value differs from ServeConfig's default, so "the file's value survived" is observable
FILE = """\
host: 0.0.0.0
port: 9002
mode: distributed
engine:
  model: gemma3-270m
  slots: 6
  threads: 1
  n_ctx: 2048
  exact: true
  chain:
    speculators: [suffix]
    policy: first
    n_max: 4
    params: {suffix: {min_match: 2}}
"""


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture()
def cfg_file(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text(FILE)
    return str(f)


def test_no_flags_gives_serveconfig_defaults():
    assert flag_overrides(parse()) == {}
    assert config_from_args(parse(), environ={}) == ServeConfig()


def test_file_only_keeps_every_file_value(cfg_file):
    cfg = config_from_args(parse("--config", cfg_file))
    assert (cfg.host, cfg.port, cfg.mode) == ("0.0.0.0", 9002, "distributed")
    e = cfg.engine
    assert (e.model, e.slots, e.threads, e.n_ctx, e.exact) == ("gemma3-270m", 6, 1, 2048, True)
    assert (e.chain.speculators, e.chain.policy, e.chain.n_max) == (["suffix"], "first", 4)
    assert e.chain.params == {"suffix": {"min_match": 2}}


def test_explicit_flag_equal_to_the_default_still_wins_over_the_file(cfg_file):
    d, de = ServeConfig(), EngineConfig()
    cfg = config_from_args(parse("--config", cfg_file, "--slots", str(de.slots), "--port", str(d.port),
                                 "--mode", d.mode, "--host", d.host,
                                 "--n-ctx", str(de.n_ctx), "--model", de.model,
                                 "--policy", de.chain.policy, "--n-max", str(de.chain.n_max)))
    assert (cfg.host, cfg.port, cfg.mode) == (d.host, d.port, d.mode)
    e = cfg.engine
    # (threads has no value to repeat: unset, it is decided where the target runs)
    assert (e.slots, e.n_ctx, e.model) == (de.slots, de.n_ctx, de.model)
    assert (e.chain.policy, e.chain.n_max) == (de.chain.policy, de.chain.n_max)
    assert e.exact is True and e.chain.speculators == ["suffix"]  # not given: still the file's


def test_file_plus_other_flag_changes_only_that_field(cfg_file):
    cfg = config_from_args(parse("--config", cfg_file, "--port", "8123"))
    assert cfg.port == 8123
    expected = config_from_args(parse("--config", cfg_file)).model_copy(update={"port": 8123})
    assert cfg == expected


def test_flags_without_file_override_the_defaults():
    cfg = config_from_args(parse("--slots", "3", "--mode", "distributed", "--n-ctx", "1024"))
    assert (cfg.engine.slots, cfg.mode, cfg.engine.n_ctx) == (3, "distributed", 1024)
    assert cfg.port == ServeConfig().port and cfg.engine.threads == EngineConfig().threads


def test_exact_and_no_exact(cfg_file):
    assert config_from_args(parse("--exact")).engine.exact is True
    assert config_from_args(parse()).engine.exact is False
    assert config_from_args(parse("--config", cfg_file)).engine.exact is True
    assert config_from_args(parse("--config", cfg_file, "--no-exact")).engine.exact is False
    assert "exact" not in flag_overrides(parse("--config", cfg_file)).get("engine", {})


def test_flash_attn_flag_and_its_conflict_with_exact(capsys):
    assert config_from_args(parse("--flash-attn")).engine.flash_attn is True
    assert config_from_args(parse("--no-flash-attn")).engine.flash_attn is False
    assert "flash_attn" not in flag_overrides(parse()).get("engine", {})
    for argv in (["serve", "--exact", "--flash-attn"], ["generate", "--prompt", "hi", "--exact", "--flash-attn"],
                 ["bench", "--exact", "--flash-attn"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "--flash-attn conflicts with --exact" in capsys.readouterr().err


def test_spec_replaces_the_chain_and_keeps_the_files_params(cfg_file):
    cfg = config_from_args(parse("--config", cfg_file, "--spec", "ngram_mod,suffix"))
    c = cfg.engine.chain
    assert c.speculators == ["ngram_mod", "suffix"]
    assert c.params == {"suffix": {"min_match": 2}} and c.policy == "first" and c.n_max == 4
    assert config_from_args(parse("--config", cfg_file, "--spec", "none")).engine.chain.speculators == []
    assert config_from_args(parse("--spec", "suffix")).engine.chain.speculators == ["suffix"]
    with pytest.raises(ValueError):
        config_from_args(parse("--spec", "none,suffix"))


def test_api_key_flag_beats_file_beats_environment(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("api_key: from-file\n")
    env = {"SPECRAY_API_KEY": "from-env"}
    assert config_from_args(parse(), environ={}).api_key is None
    assert config_from_args(parse(), environ=env).api_key == "from-env"
    assert config_from_args(parse("--config", str(f)), environ=env).api_key == "from-file"
    assert config_from_args(parse("--config", str(f), "--api-key", "from-flag"), environ=env).api_key == "from-flag"
    assert "from-flag" not in repr(config_from_args(parse("--api-key", "from-flag"), environ={}))


def test_help_shows_the_real_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    d, de = ServeConfig(), EngineConfig()
    for text in (f"HTTP port (default: {d.port})", f"(default: {d.mode})", f"replica (default: {de.slots})",
                 f"(default: {de.model})", f"(default: {de.chain.label})", f"(default: {de.chain.n_max})"):
        assert text in out, text
    assert "SUPPRESS" not in out


def test_cli_doctests():
    """flag_message's worked example: config errors are given back in flag names."""
    import doctest

    from specray.cli import main as cli_main
    from specray.cli import serve as cli_serve

    for module, n in ((cli_main, 1), (cli_serve, 4)):  # flag_message; ray_target (which Ray cluster to use)
        failed, attempted = doctest.testmod(module)
        assert attempted >= n and failed == 0, module.__name__


def test_verify_shape_flag_reaches_the_engine_config():
    assert config_from_args(parse("--verify-shape", "bucketed"), environ={}).engine.shape_buckets == (1, 2, 4, 8, 16)
    assert "verify_shape" not in flag_overrides(parse()).get("engine", {})


def test_n_gpu_layers_flag_reaches_the_engine_config_and_rejects_negatives(capsys):
    assert config_from_args(parse("--n-gpu-layers", "20"), environ={}).engine.n_gpu_layers == 20
    # unset: None, which the model load resolves (all layers where llama.cpp offloads to a GPU, else 0)
    assert "n_gpu_layers" not in flag_overrides(parse()).get("engine", {})
    assert EngineConfig().n_gpu_layers is None
    for argv in (["serve", "--n-gpu-layers", "-1"], ["bench", "--n-gpu-layers", "-2"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--n-gpu-layers must be >= 0" in capsys.readouterr().err


def test_gpu_split_flags_reach_the_engine_config_and_bad_shares_are_refused(capsys):
    eng = config_from_args(parse("--split-mode", "row", "--tensor-split", "3,1", "--main-gpu", "1"), environ={}).engine
    assert (eng.split_mode, eng.tensor_split, eng.main_gpu) == ("row", (3.0, 1.0), 1)
    assert EngineConfig().split_mode == "layer" and EngineConfig().tensor_split is None
    for bad in ((0.0, 0.0), (1.0, -1.0), ()):
        with pytest.raises(ValueError, match="tensor_split"):
            EngineConfig(tensor_split=bad)
    with pytest.raises(SystemExit):
        main(["bench", "--tensor-split", "3,x"])
    assert "--tensor-split: expected comma-separated numbers" in capsys.readouterr().err


def test_direct_writes_flag_and_its_default():
    assert ServeConfig().direct_writes is True
    assert config_from_args(parse("--no-direct-writes"), environ={}).direct_writes is False
    assert config_from_args(parse("--direct-writes"), environ={}).direct_writes is True
    assert "direct_writes" not in flag_overrides(parse())


def test_quiet_ray_flag_and_its_settings():
    """On by default; the settings only slow loops that Ray runs at 10 Hz or 5 Hz (cluster/ray_env.py)."""
    import doctest

    from specray.cluster import ray_env

    assert parse().quiet_ray is True and parse("--no-quiet-ray").quiet_ray is False
    failed, attempted = doctest.testmod(ray_env)
    assert attempted >= 4 and failed == 0
    assert ray_env.quiet_ray_env({}) == ray_env.QUIET_RAY_ENV
    assert set(ray_env.QUIET_RAY_ENV) >= {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"}
    assert all(float(v) > 0 for v in ray_env.QUIET_RAY_ENV.values())  # a slower loop, never a switched-off one


def test_ray_reads_the_quiet_settings_it_reads_in_python():
    """The names are Ray's own: a Python process with QUIET_RAY_ENV sees the slower periods in Ray's constants
    (the raylet's three are its C++ config, read through RAY_<name> like every Ray system setting). Guards a Ray
    upgrade that renames one: the setting would silently do nothing."""
    import os
    import subprocess
    import sys

    from specray.cluster.ray_env import QUIET_RAY_ENV

    code = ("import ray._private.log_monitor as lm, ray.dashboard.modules.reporter.reporter_consts as rc\n"
            "from ray.serve._private import constants as sc\n"
            "print(sc.CONTROL_LOOP_INTERVAL_S, sc.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS, "
            "lm.RAY_LOG_MONITOR_MANY_FILES_THRESHOLD, lm.LOG_NAME_UPDATE_INTERVAL_S, rc.REPORTER_UPDATE_INTERVAL_MS)")

    def read(extra):
        env = {k: v for k, v in os.environ.items() if k not in QUIET_RAY_ENV} | extra
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return [float(x) for x in out.stdout.split()]

    names = ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS",
             "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "LOG_NAME_UPDATE_INTERVAL_S", "REPORTER_UPDATE_INTERVAL_MS")
    assert read(QUIET_RAY_ENV) == [float(QUIET_RAY_ENV[k]) for k in names]
    assert read({}) == [0.1, 100.0, 1000.0, 0.5, 5000.0]  # Ray 2.60's defaults: the quiet values differ from them
