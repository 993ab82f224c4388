"""`specray bench` without a model: which prompts fit a sequence's share of the context (bench/fit.py), and
the round profiler's summary (bench/round_profile.py)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.bench import fit, round_profile
from specray.bench.fit import bench_request, cells_needed, fit_prompts, prompt_labels
from specray.bench.prompts import load_prompts
from specray.bench.report import BenchReport
from specray.bench.round_profile import RoundProfiler
from specray.engine.config import ChainConfig
from specray.engine.request import admission_plan
from specray.native import context


@pytest.mark.parametrize("module", [fit, round_profile, context], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_docstring_examples(module):
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


@pytest.mark.parametrize("configs", [["none"], ["none", "suffix"], ["none", "ngram_mod,suffix"]])
def test_a_prompt_is_kept_exactly_when_the_scheduler_would_admit_it(configs):
    chain = ChainConfig(speculators=[], n_max=16)
    n_ctx_seq, max_tokens = 512, 64
    lengths = list(range(400, 480))
    cells = [cells_needed(n, max_tokens, configs, chain) for n in lengths]
    split = fit_prompts(cells, n_ctx_seq, slots=4, kv_unified=False)
    assert split.kept and split.skipped  # the boundary lies inside the range
    for i, n in enumerate(lengths):
        toks = np.ones(n, dtype=np.int32)
        admitted = True
        for c in configs:  # every configuration's run submits this prompt
            try:
                admission_plan(bench_request(toks, max_tokens, c), chain, n_ctx_seq)
            except ValueError:
                admitted = False
        assert (i in split.kept) == admitted, (n, cells[i])
    # four KV streams, each padded to 256 cells: 768 per stream fits the longest
    assert split.n_ctx_all == 4 * 768 and max(cells) <= 768


def test_prompt_ids_come_from_the_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question_id": 95, "category": "summarization", "turns": ["Summarize this."]}\n'
                    '{"id": "x7", "category": "qa", "prompt": "Why?"}\n'
                    '{"category": "qa", "prompt": "How?"}\n')
    prompts = load_prompts(str(path), None, None)
    assert [p.id for p in prompts] == ["95", "x7", None]
    assert prompt_labels([p.id for p in prompts], [p.category for p in prompts]) == [
        "summarization/95", "qa/x7", "qa#2"]


def test_the_table_names_skipped_prompts():
    report = BenchReport(model="m", configs=["none"], categories=[])
    assert "skipped" not in report.table()
    report.meta = {"n_ctx_seq": 1024, "skipped_prompts": 2, "n_ctx_fitting_all": 8192,
                   "skipped": [{"prompt": "summarization/95", "cells": 1200},
                               {"prompt": "summarization/97", "cells": 1900}]}
    assert report.table().endswith("skipped 2 prompts too long for 1024 cells per sequence (summarization/95, "
                                   "summarization/97); --n-ctx 8192 fits them all")


class Worker:
    def busy(self, n: int) -> int:
        return sum(i * i for i in range(n))


def test_profile_summary_names_functions_by_class_and_counts_rounds():
    prof = RoundProfiler()
    w = Worker()
    for _ in range(3):
        with prof.round("a"):
            w.busy(20000)
    with prof.round("b"):
        w.busy(10)
    text = prof.summary(top=5)
    assert prof.rounds == {"a": 3, "b": 1} and prof.seconds["a"] > prof.seconds["b"] > 0
    assert "== a: 3 rounds" in text and "== b: 1 rounds" in text
    # named by path relative to the package root and qualified name, with 3 calls in config a
    label = f"tests/unit/test_bench_fit.py:{Worker.busy.__code__.co_firstlineno} Worker.busy"
    line = next(ln for ln in text.splitlines() if ln.endswith(label))
    assert line.split()[3] == "3"
    # no Context.launch ran: llama_decode's share is zero, the host's all of it
    assert "llama_decode: 0.000 s (0%" in text
