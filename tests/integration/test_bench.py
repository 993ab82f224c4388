"""`specray bench` for real but tiny: the JSON contract other tools read, and its figures add up."""

from __future__ import annotations

import json

import pytest

from specray.deployments.bench import BenchPrompt, run_bench, write_json


@pytest.fixture(scope="module")
def report():
    prompts = [
        BenchPrompt("copy", prompt="Repeat after me: one two three four five, one two three four five, one two"),
        BenchPrompt("copy", prompt="a b c d e f g a b c d e f g a b c d e f g a b c"),
        BenchPrompt("chat", messages=[{"role": "user", "content": "Name three primary colors."}]),
    ]
    return run_bench(model="smollm2-135m", configs=["ngram_simple", "suffix"], prompts=prompts, max_tokens=24,
                     slots=2, exact=False, policy="cost", n_max=8, threads=2, n_ctx=1024, progress=lambda s: None)


def test_json_contract(report, tmp_path):
    path = tmp_path / "bench.json"
    write_json(report, str(path))
    js = json.loads(path.read_text())
    assert list(js["configs"]) == ["none", "llama_cpp", "ngram_simple", "suffix"]
    for name, entry in js["configs"].items():
        assert isinstance(entry["mismatches"], int) and isinstance(entry["tie_divergences"], int)
        assert len(entry["mismatch_margins"]) == entry["mismatches"]
        assert set(entry["categories"]) == {"copy", "chat"}
        for row in entry["categories"].values():
            for key in ("tokens_per_s", "mean_acceptance_length", "acceptance_rate", "speedup"):
                assert isinstance(row[key], float), (name, key)
            assert row["tokens_per_s"] > 0 and row["mean_acceptance_length"] >= 1.0
            assert 0.0 <= row["acceptance_rate"] <= 1.0
    assert js["configs"]["none"]["categories"]["copy"]["speedup"] == 1.0
    # two slots: the tie bound covers both measured drifts (batched vs one by one; KV layout)
    assert js["layout_variance"] >= 0.0 and js["batch_variance"] >= 0.0
    assert js["tie_bound"] == 2.0 * max(js["batch_variance"], js["layout_variance"])
    assert js["meta"]["flash_attn"] is False


def test_figures_add_up(report):
    for cat in report.categories:
        none = report.results[cat]["none"]
        # generation speed leaves prompt processing out: it is faster than the end-to-end rate
        assert 0 < none.prefill_seconds < none.seconds
        assert none.tokens_per_s > none.e2e_tokens_per_s
        for cfg in ("ngram_simple", "suffix"):
            r = report.results[cat][cfg]
            assert r.compared == 2 if cat == "copy" else r.compared == 1
            assert r.identical + r.mismatches + r.tie_divergences == r.compared
            assert r.accepted <= r.drafted
            # every sent draft is counted under the speculator that made it
            assert set(r.by_speculator) <= {cfg}
            assert sum(c.drafts for c in r.by_speculator.values()) == r.drafts
            # the time split per round: drafting and verification are parts of the round's wall time
            assert r.rounds > 0 and 0 < r.verify_seconds and 0 < r.draft_seconds
            assert r.draft_seconds + r.verify_seconds < r.seconds
        assert none.rounds > 0 and none.draft_seconds < report.results[cat]["suffix"].draft_seconds
        # the default order (lockstep) runs each configuration once, on its own context, and measures each
        # against the `none` run it advanced with
        assert none.sequences == report.results[cat]["suffix"].sequences
        assert report.baselines[cat]["suffix"].seconds == none.seconds
    # the repetitive prompts are drafted for and (mostly) accepted
    copy = report.results["copy"]["suffix"]
    assert copy.drafts > 0 and copy.accepted > 0, copy
    assert report.results["copy"]["none"].drafts == 0


def test_repeats_are_independent_passes():
    prompts = [BenchPrompt("chat", messages=[{"role": "user", "content": "Describe a quiet harbour at dawn."}])]
    report = run_bench(model="smollm2-135m", configs=["suffix"], prompts=prompts, max_tokens=48, slots=1,
                       exact=False, policy="cost", n_max=8, threads=2, n_ctx=1024, progress=lambda s: None,
                       llama_baseline=False, repeats=2, order="sandwich")
    passes = report.repeat_results["chat"]
    # sandwich: `none` before and after `suffix` in each pass, which is measured against both
    for p, base in zip(passes, report.repeat_baselines["chat"]):
        assert p["none"].sequences == 2 and p["suffix"].sequences == 1 and base["suffix"].sequences == 2
    assert len(passes) == 2
    for cfg in ("none", "suffix"):
        assert report.results["chat"][cfg].tokens == sum(p[cfg].tokens for p in passes)
        assert all(p[cfg].tokens > 0 for p in passes)
    # each pass has fresh speculators: with the first pass's chain, the suffix tree shared across requests
    # would hold this very answer and the second pass would draft nearly all of it
    first, second = passes[0]["suffix"], passes[1]["suffix"]
    assert second.accepted <= first.accepted + 8, (first.accepted, second.accepted)
    row = report.to_json()["configs"]["suffix"]
    assert len(row["categories"]["chat"]["speedup_per_repeat"]) == 2
    assert all(s > 0 for s in row["overall"]["speedup_per_repeat"])
    assert "range" in report.table()
