"""The bench's default prompts ship inside the package: Spec-Bench's 480 questions (with their license) and the
JSON-extraction set, found from the package's own folder, and they are what `specray bench` and
`specray train-head` read without --prompts (SPECRAY_SPEC_BENCH still overrides them)."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

import specray.bench
from specray.bench import prompts as bench_prompts
from specray.bench.prompts import bundled_prompts, default_prompts_path, load_prompts
from specray.cli import main as cli

PACKAGE_DIR = Path(specray.bench.__file__).resolve().parent


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv("SPECRAY_SPEC_BENCH", raising=False)


def test_doctests():
    failed, attempted = doctest.testmod(bench_prompts)
    assert attempted > 0 and failed == 0


def test_default_is_the_shipped_spec_bench(no_override):
    path = Path(default_prompts_path())
    assert path == PACKAGE_DIR / "data" / "spec_bench.jsonl" and path.is_file()
    assert "Apache License" in (PACKAGE_DIR / "data" / "SPEC_BENCH_LICENSE").read_text()
    assert "shared" not in path.parts  # nothing outside the repository or the installed package
    lines = path.read_text().splitlines()
    assert len(lines) == 480
    objs = [json.loads(line) for line in lines]
    # the fields the bench reads: a category, an id for the reports, and the user turns
    assert all(isinstance(o["question_id"], int) and o["category"] and o["turns"] and
               all(isinstance(t, str) and t for t in o["turns"]) for o in objs)
    assert len({o["question_id"] for o in objs}) == 480
    assert len({o["category"] for o in objs}) == 13


def test_the_bench_parser_reads_every_shipped_question(no_override):
    ps = load_prompts(default_prompts_path(), None, None)
    assert len(ps) == 480 and all(p.messages and p.messages[0]["role"] == "user" for p in ps)
    assert ps[0].id == "81" and ps[0].category == "writing"


def test_the_override_still_wins(monkeypatch, tmp_path):
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "hi", "category": "x"}\n')
    monkeypatch.setenv("SPECRAY_SPEC_BENCH", str(own))
    assert default_prompts_path() == str(own)
    monkeypatch.setenv("SPECRAY_SPEC_BENCH", str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="SPECRAY_SPEC_BENCH"):
        default_prompts_path()


def test_json_extraction_is_found_the_same_way():
    path = Path(bundled_prompts("json_extraction.jsonl"))
    assert path.parent == PACKAGE_DIR / "data"
    ps = load_prompts(str(path), None, None)
    assert len(ps) == 24 and all(p.json_schema for p in ps)
    with pytest.raises(FileNotFoundError):
        bundled_prompts("no-such.jsonl")


class _Loaded(Exception):
    pass


def test_specray_bench_without_prompts_loads_the_shipped_file(no_override, monkeypatch):
    """`specray bench` with no --prompts hands the shipped file to the prompt parser (stopped there, before any
    model loads)."""
    import specray.bench.run as run

    seen = []

    def fake_load(path, categories, per_category):
        seen.append((path, categories, per_category))
        raise _Loaded

    monkeypatch.setattr(run, "load_prompts", fake_load)
    with pytest.raises(_Loaded):
        cli.main(["bench", "--configs", "none", "ngram_mod", "--per-category", "1", "--max-tokens", "32"])
    assert seen == [(str(PACKAGE_DIR / "data" / "spec_bench.jsonl"), None, 1)]
    assert cli.build_parser().parse_args(["bench"]).prompts is None


def test_train_head_without_prompts_reads_the_shipped_file(no_override):
    from specray.cli.train_head import config_from_args

    args = cli.build_parser().parse_args(["train-head", "--out", "/tmp/head.gguf"])
    assert args.prompts is None
    assert config_from_args(args).prompts == str(PACKAGE_DIR / "data" / "spec_bench.jsonl")


def test_train_accept_reads_the_same_default(no_override):
    """`python -m specray.train.accept` may not import bench (docs/architecture.md): its own look-up must agree."""
    from specray.train import accept

    assert accept.default_prompts_path() == default_prompts_path()
