"""The draft model's load options (DraftModelConfig: threads, batch sizes, GPU layers and device, KV cache types,
flash attention): what each unset one follows, llama.cpp's rules checked before anything loads, and the
--draft-<option> flags of generate, bench and serve (no model, no Ray)."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

from specray.cli.main import build_parser, main
from specray.cli.serve import config_from_args
from specray.engine import config as config_module
from specray.engine.config import DRAFT_LOAD_FIELDS, DraftModelConfig, EngineConfig


def test_unset_options_follow_the_target_as_before():
    s = EngineConfig(threads=3, n_batch=256, draft={"model": "smollm2-135m"}).draft_settings()
    assert (s.threads, s.threads_batch, s.n_batch, s.n_ubatch) == (3, 3, 256, 256)
    assert (s.n_gpu_layers, s.main_gpu, s.split_mode) == (None, 0, "layer")
    # flash attention as the target decides it: on by default, off with exact mode or when turned off
    assert (s.cache_type_k, s.cache_type_v, s.flash_attn) == ("f16", "f16", True)
    assert EngineConfig(exact=True).draft_settings().flash_attn is False
    assert EngineConfig(flash_attn=False).draft_settings().flash_attn is False
    # the engine's flash attention and main GPU; a row or tensor split becomes whole layers for the small draft
    s = EngineConfig(flash_attn=True, main_gpu=1, split_mode="row").draft_settings()
    assert (s.flash_attn, s.main_gpu, s.split_mode) == (True, 1, "layer")
    assert EngineConfig(split_mode="none", main_gpu=1).draft_settings().split_mode == "none"


def test_set_options_win():
    d = {"threads": 1, "threads_batch": 2, "n_batch": 64, "n_ubatch": 32, "n_gpu_layers": 5, "main_gpu": 1,
         "cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": True}
    s = EngineConfig(threads=3, main_gpu=0, draft=d).draft_settings()
    assert (s.threads, s.threads_batch, s.n_batch, s.n_ubatch, s.n_gpu_layers) == (1, 2, 64, 32, 5)
    # a draft pinned to one GPU loads whole onto it (llama.cpp's -devd with one device)
    assert (s.main_gpu, s.split_mode) == (1, "none")
    assert (s.cache_type_k, s.cache_type_v, s.flash_attn) == ("q8_0", "q4_0", True)


def test_a_quantised_v_cache_turns_flash_attention_on_unless_it_is_refused():
    assert EngineConfig(draft={"cache_type_v": "q8_0"}).draft_settings().flash_attn is True
    assert EngineConfig(flash_attn=False, draft={"cache_type_v": "q8_0"}).draft_settings().flash_attn is True
    assert EngineConfig(flash_attn=False, draft={"cache_type_k": "q8_0"}).draft_settings().flash_attn is False
    with pytest.raises(ValidationError, match="cache_type_v q8_0 .*needs flash attention.*flash_attn"):
        DraftModelConfig(cache_type_v="q8_0", flash_attn=False)
    DraftModelConfig(cache_type_v="bf16", flash_attn=False)  # not quantised: fine


@pytest.mark.parametrize("bad, words", [
    ({"cache_type_k": "q3_k"}, "cache_type_k"), ({"cache_type_v": "F16"}, "cache_type_v"),
    ({"n_gpu_layers": -1}, "n_gpu_layers"), ({"main_gpu": -1}, "main_gpu"), ({"threads_batch": 0}, "threads_batch"),
    ({"n_batch": 8}, "n_batch"), ({"n_ubatch": 64, "n_batch": 32}, "n_ubatch \\(64\\) exceeds n_batch"),
    ({"flash_attn": "maybe"}, "flash_attn"), ({"threads_btach": 2}, "threads_btach"),
])
def test_bad_values_are_refused_naming_the_option(bad, words):
    with pytest.raises(ValidationError, match=words):
        DraftModelConfig(**bad)


def test_n_ubatch_is_checked_against_the_engines_n_batch_when_the_draft_has_none():
    with pytest.raises(ValidationError, match="draft.n_ubatch \\(128\\) exceeds .*engine's n_batch \\(64\\)"):
        EngineConfig(n_batch=64, draft={"n_ubatch": 128})
    EngineConfig(n_batch=64, draft={"n_ubatch": 128, "n_batch": 128})


def test_config_doctests():
    failed, attempted = doctest.testmod(config_module)
    assert failed == 0 and attempted >= 2


FLAGS = ["--draft-model", "smollm2-135m", "--draft-n-ctx", "640", "--draft-threads", "1", "--draft-threads-batch",
         "2", "--draft-n-batch", "128", "--draft-n-ubatch", "64", "--draft-n-gpu-layers", "7", "--draft-main-gpu", "1",
         "--draft-cache-type-k", "q8_0", "--draft-cache-type-v", "q8_0", "--draft-flash-attn"]
WANT = {"model": "smollm2-135m", "n_ctx": 640, "threads": 1, "threads_batch": 2, "n_batch": 128, "n_ubatch": 64,
        "n_gpu_layers": 7, "main_gpu": 1, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": True}


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"]])
def test_generate_and_bench_flags_make_the_draft_config(command):
    args = build_parser().parse_args(command + FLAGS)
    assert DraftModelConfig.from_flags(args).model_dump(include=set(WANT)) == WANT
    # absent flags leave the defaults
    assert DraftModelConfig.from_flags(build_parser().parse_args(command)) == DraftModelConfig()


def test_serve_flags_reach_the_engine_config_and_absent_ones_do_not(tmp_path):
    cfg = config_from_args(build_parser().parse_args(["serve", *FLAGS]), environ={})
    assert cfg.engine.draft.model_dump(include=set(WANT)) == WANT
    f = tmp_path / "serve.yaml"
    f.write_text("engine:\n  draft:\n    model: smollm2-135m\n    cache_type_k: q4_0\n    threads_batch: 3\n")
    cfg = config_from_args(build_parser().parse_args(["serve", "--config", str(f), "--draft-cache-type-v", "q8_0"]),
                           environ={})
    d = cfg.engine.draft
    assert (d.cache_type_k, d.cache_type_v, d.threads_batch, d.flash_attn) == ("q4_0", "q8_0", 3, None)
    assert set(DRAFT_LOAD_FIELDS) <= set(DraftModelConfig.model_fields)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"], ["serve"]])
@pytest.mark.parametrize("flags, said", [
    (["--draft-n-gpu-layers", "-1"], "--draft-n-gpu-layers -1: Input should be greater than or equal to 0"),
    (["--draft-main-gpu", "-2"], "--draft-main-gpu -2"),
    (["--draft-threads-batch", "0"], "--draft-threads-batch 0"),
    (["--draft-cache-type-v", "q4_0", "--no-draft-flash-attn"],
     "--draft-cache-type-v q4_0 (a quantised V cache) needs flash attention in llama.cpp: leave --draft-flash-attn"),
    (["--draft-n-batch", "32", "--draft-n-ubatch", "64"], "--draft-n-ubatch (64) exceeds --draft-n-batch (32)"),
    (["--draft-cache-type-k", "q3_k"], "argument --draft-cache-type-k: invalid choice: 'q3_k'"),
])
def test_bad_flags_are_a_cli_error_naming_the_flag(command, flags, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(command + flags)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_help_lists_the_draft_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--draft-threads-batch", "--draft-n-gpu-layers", "--draft-main-gpu", "--draft-cache-type-k",
                 "--draft-cache-type-v", "--draft-flash-attn", "--draft-n-ubatch"):
        assert flag in out
