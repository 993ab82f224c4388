"""CLI flags of the hidden-state speculators: --mtp, --eagle3-model, --dflash-model, --hidden-transport (no model
load)."""

from __future__ import annotations

import pytest

from specray.cli.main import build_parser, main
from specray.cli.serve import config_from_args


def test_serve_flags_map_to_the_engine_config_and_absent_flags_do_not():
    args = build_parser().parse_args(["serve", "--mtp", "--eagle3-model", "/x/e3.gguf", "--dflash-model",
                                      "/x/df.gguf", "--hidden-transport", "cuda_ipc", "--mode", "distributed"])
    h = config_from_args(args, environ={}).engine.hidden
    assert h.mtp and h.eagle3_model == "/x/e3.gguf" and h.dflash_model == "/x/df.gguf" and h.transport == "cuda_ipc"
    h = config_from_args(build_parser().parse_args(["serve"]), environ={}).engine.hidden
    assert not h.enabled and h.transport == "object_store"


def test_generate_flags_and_help_explain_themselves(capsys):
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--mtp", "--spec", "mtp"])
    assert args.mtp and args.eagle3_model is None and args.dflash_model is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--mtp" in out and "NextN" in out and "--eagle3-model" in out and "--hidden-transport" in out
    assert "--dflash-model" in out and "block" in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hidden-transport", "pigeon"])


def test_bad_eagle3_path_names_the_flag(capsys, tmp_path):
    rc = main(["generate", "--prompt", "hi", "--eagle3-model", str(tmp_path / "missing.gguf"), "--spec", "eagle3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--eagle3-model" in err and "missing.gguf" in err


def test_bad_dflash_path_names_the_flag(capsys, tmp_path):
    rc = main(["generate", "--prompt", "hi", "--dflash-model", str(tmp_path / "missing.gguf"), "--spec", "dflash"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dflash-model" in err and "missing.gguf" in err


def test_an_eagle3_file_is_not_a_dflash_draft(capsys):
    from ..hidden_models import eagle3_draft

    rc = main(["generate", "--prompt", "hi", "--dflash-model", eagle3_draft(), "--spec", "dflash"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dflash-model" in err and "not a DFlash draft" in err
