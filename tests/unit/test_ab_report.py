"""ab-report statistics: bootstrap intervals, the winner rule, the printed table and the plot (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specray.bench.ab_report import (
    Estimate,
    bootstrap,
    build_report,
    format_report,
    plot_report,
    ratio_of_means,
    separated_winner,
)
from specray.cli.main import main
from specray.deployments.replica.metrics import EngineMetrics, spec_totals


def _arm(chain: str, itl: np.ndarray, drafts=None, accepted=None, drafted=None, ttft=None) -> dict:
    n = len(itl)
    drafts = np.zeros(n, int) if drafts is None else drafts
    accepted = np.zeros(n, int) if accepted is None else accepted
    drafted = np.zeros(n, int) if drafted is None else drafted
    ttft = np.full(n, 0.05) if ttft is None else ttft
    rec = {"t": [0.0] * n, "prompt_tokens": [10] * n, "completion_tokens": [64] * n,
           "ttft_s": ttft.tolist(), "itl_s": itl.tolist(), "e2e_s": (ttft + 63 * itl).tolist(),
           "drafts": drafts.tolist(), "drafted": drafted.tolist(), "accepted": accepted.tolist()}
    return {"chain": chain, "requests": n, "errors": 0, "records": rec}


def test_bootstrap_interval_covers_the_true_mean_at_about_95_percent():
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(200):
        x = rng.exponential(2.0, size=40)
        e = bootstrap(lambda a: a.mean(axis=1), (x,), n_boot=400, seed=i)
        assert e.lo <= e.value <= e.hi
        hits += e.lo <= 2.0 <= e.hi
    assert 0.85 <= hits / 200 <= 0.99  # percentile bootstrap on n=40 undercovers a little


def test_ratio_of_means_and_degenerate_inputs():
    a, b = np.full(30, 3.0), np.full(30, 2.0)
    e = ratio_of_means(a + np.linspace(-0.1, 0.1, 30), b)
    assert e.value == pytest.approx(1.5) and e.lo < 1.5 < e.hi
    assert ratio_of_means(np.array([]), b).value is None
    assert bootstrap(lambda x: x.mean(axis=1), (np.array([]),)).value is None
    one = bootstrap(lambda x: x.mean(axis=1), (np.array([4.0]),))
    assert one.value == 4.0 and one.lo is None


def test_winner_only_when_intervals_separate():
    assert separated_winner({"a": Estimate(10, 9, 11), "b": Estimate(15, 12, 18)}) == "b"
    assert separated_winner({"a": Estimate(10, 9, 12.5), "b": Estimate(15, 12, 18)}) is None
    assert separated_winner({"a": Estimate(10, 9, 11), "b": Estimate(None)}) is None
    assert separated_winner({"a": Estimate(10, 9, 11)}) is None


def test_report_names_the_faster_arm_with_its_speedup():
    rng = np.random.default_rng(0)
    n = 60
    base = _arm("none", rng.normal(0.020, 0.002, n))  # ~50 tok/s
    drafts = rng.integers(10, 20, n)
    fast = _arm("ngram_mod,suffix", rng.normal(0.0125, 0.0015, n), drafts=drafts, drafted=drafts * 4,
                accepted=drafts * 2)  # ~80 tok/s, 2 of 4 draft tokens accepted
    rep = build_report({"arms": {"base": base, "fast": fast}}, n_boot=500)
    by = {a.name: a for a in rep.arms}
    assert rep.baseline == "base" and rep.winner == "fast"
    assert by["fast"].speedup.lo > 1.4 and by["fast"].speedup.hi < 1.8
    assert by["fast"].mean_acceptance_length.value == pytest.approx(3.0)
    assert by["fast"].acceptance_rate.value == pytest.approx(0.5)
    assert by["base"].mean_acceptance_length.value == 1.0 and by["base"].acceptance_rate.value is None
    assert by["base"].ttft[50].value == pytest.approx(0.05)
    text = format_report(rep)
    assert "winner: fast" in text and "base" in text and "ngram_mod,suffix" in text and "[" in text


def test_overlapping_arms_get_no_winner():
    rng = np.random.default_rng(2)
    a = _arm("none", rng.normal(0.02, 0.004, 12))
    b = _arm("suffix", rng.normal(0.0195, 0.004, 12))
    rep = build_report({"arms": {"a": a, "b": b}}, n_boot=500)
    assert rep.winner is None and "no winner" in format_report(rep)
    with pytest.raises(ValueError, match="arms"):
        build_report({"mode": "colocated"})


def test_cli_from_a_saved_run_prints_both_arms_and_draws_the_plot(tmp_path, capsys):
    rng = np.random.default_rng(3)
    stats = {"arms": {"base": _arm("none", rng.normal(0.02, 0.002, 20)),
                      "fast": _arm("suffix", rng.normal(0.015, 0.002, 20), drafts=np.full(20, 5),
                                   drafted=np.full(20, 10), accepted=np.full(20, 6))}}
    src, png, out = tmp_path / "run.json", tmp_path / "ab.png", tmp_path / "rep.json"
    src.write_text(json.dumps(stats))
    assert main(["ab-report", "--from", str(src), "--plot", str(png), "--json", str(out), "--bootstrap", "300"]) == 0
    text = capsys.readouterr().out
    assert "base" in text and "fast" in text and "95%" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(out.read_text())
    assert [a["name"] for a in rep["arms"]] == ["base", "fast"] and rep["arms"][1]["tokens_per_s"]["ci95"][0] > 0
    assert main(["ab-report", "--from", str(tmp_path / "missing.json")]) == 2


def test_plot_handles_an_arm_without_data(tmp_path):
    stats = {"arms": {"a": _arm("none", np.full(5, 0.02)), "b": _arm("suffix", np.array([]))}}
    rep = build_report(stats, n_boot=100)
    plot_report(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


class _Recorder:
    """Stands in for ray.serve.metrics (Ray's exporter is exercised for real in tests/serve/test_ab.py)."""

    def __init__(self):
        self.values: dict[tuple, float] = {}

    def _make(self, kind):
        rec = self

        class M:
            def __init__(self, name, description="", boundaries=None, tag_keys=()):
                self.name = name

            def inc(self, v, tags):
                key = (self.name, tuple(sorted(tags.items())))
                rec.values[key] = rec.values.get(key, 0) + v

            def set(self, v, tags):
                rec.values[(self.name, tuple(sorted(tags.items())))] = v

            def observe(self, v, tags):
                self.inc(1, tags)

        return M

    @property
    def Counter(self):
        return self._make("c")

    Gauge = Counter
    Histogram = Counter


def test_spec_counters_are_pushed_as_deltas_and_survive_a_reset():
    rec = _Recorder()
    m = EngineMetrics("fast", slots=4, backend=rec, model="smol")
    stats = {"s": {"drafts_chosen": 2, "tokens_generated": 8, "tokens_accepted": 3, "accepted_per_pos": [2, 1]}}
    m.after_round(stats, busy=2, waiting=0, idle=True)
    stats["s"] = {"drafts_chosen": 5, "tokens_generated": 20, "tokens_accepted": 9, "accepted_per_pos": [4, 3, 2]}
    m.after_round(stats, busy=1, waiting=0)  # rate-limited: nothing pushed yet
    assert rec.values[("specray_spec_decode_num_drafts", (("arm", "fast"), ("model", "smol")))] == 2
    m.after_round(stats, busy=0, waiting=0, idle=True, host={"bytes": 4096, "entries": 2})
    v = rec.values
    assert v[("specray_prefix_cache_host_bytes", (("arm", "fast"), ("model", "smol")))] == 4096
    assert v[("specray_spec_decode_num_drafts", (("arm", "fast"), ("model", "smol")))] == 5
    assert v[("specray_spec_decode_num_accepted_tokens", (("arm", "fast"), ("model", "smol")))] == 9
    assert v[("specray_spec_decode_num_accepted_tokens_per_pos", (("arm", "fast"), ("model", "smol"), ("position", "2")))] == 2
    assert v[("specray_slot_occupancy", (("arm", "fast"), ("model", "smol")))] == 0
    m.after_round({"s": {"drafts_chosen": 1, "tokens_generated": 2, "tokens_accepted": 1,
                         "accepted_per_pos": [1]}}, 0, 0, idle=True)  # speculators rebuilt: counts restart
    assert v[("specray_spec_decode_num_drafts", (("arm", "fast"), ("model", "smol")))] == 6
    assert spec_totals(stats) == (5, 20, 9, [4, 3, 2])


def test_tree_counters_are_pushed_as_deltas_by_rank():
    rec = _Recorder()
    m = EngineMetrics("fast", slots=4, backend=rec, model="smol")
    tags = (("arm", "fast"), ("model", "smol"))
    trees = {"suffix": {"drafts": 3, "branches": 4, "accepted_by_rank": [2, 1]},
             "ngram_map_k4v": {"drafts": 1, "branches": 1, "accepted_by_rank": [1]}}
    m.after_round({}, busy=1, waiting=0, idle=True, trees=trees)
    trees["suffix"] = {"drafts": 5, "branches": 7, "accepted_by_rank": [3, 1, 1]}
    m.after_round({}, busy=0, waiting=0, idle=True, trees=trees)
    v = rec.values
    assert v[("specray_spec_decode_num_tree_drafts", tags)] == 6
    assert v[("specray_spec_decode_num_tree_branches", tags)] == 8
    assert [v[("specray_spec_decode_num_tree_accepted_branch", tags + (("rank", str(r)),))] for r in range(3)] == [4, 1, 1]
