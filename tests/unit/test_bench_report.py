"""`specray bench`'s report without a model: the run order, speedups against each configuration's own `none`
neighbours, which speculator of a chain carried it, the plot and the progress lines."""

from __future__ import annotations

import doctest

import pytest

from specray.bench import divergence, order as bench_order, plot as bench_plot, probes, progress as bench_progress
from specray.bench.divergence import classify_divergence, compare_runs as _compare, divergence_margin
from specray.bench.lockstep import run_lockstep as _run_lockstep
from specray.bench.order import baseline_positions, reversed_turn, run_order
from specray.bench.plot import Bar, plot_bench
from specray.bench.progress import Progress
from specray.bench.report import BenchReport, ConfigResult
from specray.engine.request import SpecCounters


@pytest.mark.parametrize("module", [bench_order, divergence, probes, bench_progress, bench_plot],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_docstring_examples(module):
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


@pytest.mark.parametrize("reverse", [False, True])
def test_sandwich_puts_none_next_to_every_other_configuration(reverse):
    configs = ["none", "llama_cpp", "a", "a,b"]
    seq = run_order(configs, "sandwich", reverse)
    assert seq[0] == seq[-1] == "none" and seq.count("none") == 4
    assert sorted(c for c in seq if c != "none") == ["a", "a,b", "llama_cpp"]
    for i, c in enumerate(seq):
        if c != "none":
            assert [seq[j] for j in baseline_positions(seq, i)] == ["none", "none"]


def test_a_single_pass_of_one_group_per_category_alternates_the_turn_order():
    # several slots run a whole category as one group: the order must still flip between categories
    flips = [reversed_turn(0, c, 0) for c in range(6)]
    assert flips.count(True) == flips.count(False) == 3
    assert all(a != b for a, b in zip(flips, flips[1:]))
    # and over two passes every (category, group) runs once each way
    for c in range(3):
        for g in range(3):
            assert {reversed_turn(0, c, g), reversed_turn(1, c, g)} == {False, True}


class _Rounds:
    """A configuration's run that needs `n` rounds, logging each one."""

    def __init__(self, name: str, n: int, log: list[str]) -> None:
        self.name, self.left, self.log, self.seconds = name, n, log, 0.0

    def step(self) -> bool:
        self.log.append(self.name)
        self.seconds += 0.01
        self.left -= 1
        return self.left > 0

    def result(self, steal_seconds: float):
        return ConfigResult(self.name, seconds=self.seconds, steal_seconds=steal_seconds), None


def test_lockstep_advances_every_configuration_a_round_at_a_time():
    log: list[str] = []
    done = _run_lockstep({"none": _Rounds("none", 3, log), "a": _Rounds("a", 1, log), "b": _Rounds("b", 2, log)})
    # rounds alternate until each run is done; a finished run drops out
    assert log == ["none", "a", "b", "none", "b", "none"]
    assert {c: r.seconds for c, (r, _) in done.items()} == pytest.approx({"none": 0.03, "a": 0.01, "b": 0.02})
    assert all(r.steal_seconds >= 0 for r, _ in done.values())


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of lockstep, sandwich, alternate"):
        run_order(["none", "a"], "random", False)


def _run(name: str, tok_s: float, tokens: int = 100) -> ConfigResult:
    return ConfigResult(name, tokens=tokens, seconds=tokens / tok_s, loaded_tokens=tokens,
                        loaded_seconds=tokens / tok_s)


def test_speedup_is_against_the_neighbouring_none_runs():
    """The machine slowed steadily from 90 to 70 tok/s while two configurations that do exactly what
    `none` does ran: each is ~1.00x of its own neighbours, where against all `none` runs pooled the
    first would look 7% faster and the second 6% slower."""
    seq = ["none", "a", "none", "b", "none"]
    runs = [_run(c, tok_s) for c, tok_s in zip(seq, (90, 85, 80, 75, 70))]
    report = BenchReport(model="m", configs=["none", "a", "b"], categories=["cat"])
    report.results["cat"] = {c: ConfigResult(c) for c in report.configs}
    report.baselines["cat"] = {c: ConfigResult("none") for c in report.configs}
    for i, (c, r) in enumerate(zip(seq, runs)):
        report.results["cat"][c].add(r)
        for j in baseline_positions(seq, i):
            report.baselines["cat"][c].add(runs[j])
    js = report.to_json()["configs"]
    assert js["none"]["categories"]["cat"]["speedup"] == pytest.approx(1.0)
    for c in ("a", "b"):
        assert js[c]["categories"]["cat"]["speedup"] == pytest.approx(1.0, abs=0.01)
        assert js[c]["overall"]["speedup"] == pytest.approx(1.0, abs=0.01)
    pooled = report.results["cat"]["none"].tokens_per_s
    assert 85 / pooled > 1.06 and 75 / pooled < 0.95


def test_a_chain_row_says_whose_drafts_were_sent():
    report = BenchReport(model="m", configs=["none", "ngram_mod,suffix"], categories=["a", "b"])
    for cat, (mod, suf) in {"a": (SpecCounters(2, 40, 39), SpecCounters(5, 10, 6)),
                            "b": (SpecCounters(1, 8, 0), SpecCounters(0, 0, 0))}.items():
        chain = _run("ngram_mod,suffix", 80)
        chain.add(ConfigResult("ngram_mod,suffix", by_speculator={"ngram_mod": mod, "suffix": suf}))
        report.results[cat] = {"none": _run("none", 80), "ngram_mod,suffix": chain}
    won = report.to_json()["configs"]["ngram_mod,suffix"]["overall"]["by_speculator"]
    assert won["ngram_mod"]["drafts"] == 3 and won["ngram_mod"]["accepted_tokens"] == 39
    assert won["suffix"]["drafted_tokens"] == 10
    assert "ngram_mod 3 (0.81)  suffix 5 (0.60)" in report.table()


def test_divergences_are_classified_by_the_margin_where_they_begin():
    base, margins = [5, 6, 7, 8], [3.0, 0.2, 4.0, 1.0]
    assert divergence_margin(base, [5, 6, 7, 8], margins) is None
    assert divergence_margin(base, [5, 9, 7, 8], margins) == 0.2
    assert divergence_margin(base, [5, 6], margins) == 4.0  # stopped early: the stop position decides
    assert classify_divergence(base, [5, 9, 1, 1], margins, tie_bound=0.5) == "tie_divergence"
    assert classify_divergence(base, [5, 6, 1, 1], margins, tie_bound=0.5) == "mismatch"
    assert classify_divergence(base, list(base), margins, tie_bound=0.0) == "identical"


def test_mismatch_margins_are_kept_per_mismatch_and_summed_over_results():
    class _Seq:
        def __init__(self, generated, margins=()):
            self.generated, self.margins = generated, list(margins)

    r = ConfigResult("a")
    _compare(r, [_Seq([1, 2, 3], [5.0, 2.5, 1.0]), _Seq([1, 2], [0.1, 0.1])], [_Seq([1, 4, 3]), _Seq([2, 2])],
             tie_bound=1.0)
    assert (r.mismatches, r.tie_divergences, r.mismatch_margins) == (1, 1, [2.5])
    total = ConfigResult("a")
    total.add(r)
    total.add(r)
    assert total.mismatch_margins == [2.5, 2.5] and r.mismatch_margins == [2.5]


def _two_pass_report() -> BenchReport:
    """Two categories, two passes: `a` is 1.25x then 1.10x on qa, 0.90x then 0.95x on math; `b` 1.05x on
    qa and as fast as `none` on math."""
    speeds = {"qa": [{"none": 80, "a": 100, "b": 84}, {"none": 80, "a": 88, "b": 84}],
              "math": [{"none": 100, "a": 90, "b": 100}, {"none": 100, "a": 95, "b": 100}]}
    report = BenchReport(model="m", configs=["none", "a", "b"], categories=["qa", "math"],
                         meta={"slots": 1, "exact": False})
    for cat, passes in speeds.items():
        report.results[cat] = {c: ConfigResult(c) for c in report.configs}
        report.repeat_results[cat] = []
        for speed in passes:
            runs = {c: _run(c, speed[c]) for c in report.configs}
            report.repeat_results[cat].append(runs)
            for c, r in runs.items():
                report.results[cat][c].add(r)
    return report


def test_plot_draws_the_speedups_and_the_spread_over_passes(tmp_path):
    report = _two_pass_report()
    path = tmp_path / "bench.png"
    bars = {(b.category, b.config): b for b in plot_bench(report, str(path))}
    # every configuration but `none` (the 1.0 line), per category, then overall
    assert list(bars) == [("qa", "a"), ("qa", "b"), ("math", "a"), ("math", "b"), ("overall", "a"), ("overall", "b")]
    # the passes summed: 200 tokens in 1 s + 100/88 s against 200 tokens in 2.5 s; whiskers: the passes
    qa = bars[("qa", "a")]
    assert qa.speedup == pytest.approx(200 / (1 + 100 / 88) / 80)
    assert (qa.lo, qa.hi) == (pytest.approx(1.10), pytest.approx(1.25))
    assert bars[("math", "a")].speedup < 1.0 and bars[("math", "a")].lo == pytest.approx(0.90)
    assert bars[("qa", "b")] == Bar("qa", "b", pytest.approx(1.05), pytest.approx(1.05), pytest.approx(1.05))
    # the same figures as the table's speedup and range columns
    js = report.to_json()["configs"]["a"]
    assert bars[("overall", "a")].speedup == pytest.approx(js["overall"]["speedup"])
    assert [bars[("overall", "a")].lo, bars[("overall", "a")].hi] == pytest.approx(
        sorted(js["overall"]["speedup_per_repeat"]))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(path)).shape
    assert width > 800 and height > 500


def test_plot_of_a_single_pass_has_no_whiskers_and_needs_none(tmp_path):
    report = BenchReport(model="m", configs=["none", "a"], categories=["qa"])
    report.results["qa"] = {"none": _run("none", 80), "a": _run("a", 60)}
    bars = plot_bench(report, str(tmp_path / "one.png"))
    # one category: no overall group; a slowdown is drawn as such
    assert bars == [Bar("qa", "a", pytest.approx(0.75))]
    assert (tmp_path / "one.png").stat().st_size > 5_000
    # a category where `none` generated nothing has no ratio to draw
    report.categories.append("empty")
    report.results["empty"] = {"none": ConfigResult("none"), "a": _run("a", 60)}
    assert [b.category for b in plot_bench(report, str(tmp_path / "two.png"))] == ["qa", "overall"]
    report.configs = ["a"]
    with pytest.raises(ValueError, match="no `none` configuration"):
        plot_bench(report, str(tmp_path / "none.png"))


def test_progress_lines_are_throttled_and_forced_at_a_category_end():
    now, lines, counted = [100.0], [], []

    def done(n):
        return lambda: counted.append(n) or n

    p = Progress(40, lines.append, every=10.0, clock=lambda: now[0])
    for t, n in ((101, 1), (105, 2), (109.9, 3)):  # a round every few seconds: nothing yet
        now[0] = t
        p.update(done(n), "qa")
    now[0] = 110.0
    p.update(done(4), "qa")
    now[0] = 112.0
    p.update(done(5), "qa")
    p.report(6, "qa")
    assert lines == ["bench: 4/40 prompt runs (10%), elapsed 0:10, ETA 1:30 [qa]",
                     "bench: 6/40 prompt runs (15%), elapsed 0:12, ETA 1:08 [qa]"]
    assert counted == [4]  # the count is taken only for a line


def test_plot_flag_is_refused_where_it_cannot_be_honoured(tmp_path, capsys):
    from specray.cli.main import main

    # the HTTP bench has no plot; a plot into a missing folder fails before the run, not after it
    assert main(["bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "a.png")]) == 2
    assert "--plot draws the in-process bench's speedups" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["bench", "--prompts", str(prompts), "--plot", str(tmp_path / "no" / "a.png")]) == 2
    assert "a.png: no such folder" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_the_round_stages_are_summed_over_categories_and_shown_per_round():
    report = BenchReport(model="m", configs=["none", "ngram_mod"], categories=["a", "b"])
    for cat in report.categories:
        report.results[cat] = {
            "none": _run("none", 80),
            "ngram_mod": _run("ngram_mod", 80)}
        report.results[cat]["ngram_mod"].add(ConfigResult(
            "ngram_mod", rounds=100, seq_rounds=200, stage_seconds={"decode": 1.0, "draft": 0.02, "verify": 0.01},
            speculator_seconds={"ngram_mod": 0.004}, speculator_asks={"ngram_mod": 200}))
    row = report.to_json()["configs"]["ngram_mod"]["overall"]
    rs = row["round_stages"]
    assert rs["ms_per_round"] == pytest.approx({"draft": 0.2, "decode": 10.0, "verify": 0.1})
    assert rs["host_ms_per_round"] == pytest.approx(0.3) and rs["host_ms_per_seq_round"] == pytest.approx(0.15)
    assert rs["speculator_ms_per_ask"] == pytest.approx({"ngram_mod": 0.02})
    table = report.table()
    assert "== round stages (overall)" in table and "ngram_mod 0.020" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("ngram_mod ") and "0.300" in ln)
    assert "10.000" in line and "0.150" in line


def test_a_row_reports_verify_rows_per_round_and_the_share_of_rounds_with_a_tree():
    report = BenchReport(model="m", configs=["none", "c+linear", "c"], categories=["a"])
    tree = _run("c", 80)
    tree.add(ConfigResult("c", rounds=10, seq_rounds=10, drafted=25, draft_rounds=8, tree_rounds=2, tree_drafts=2,
                          tree_branches=3, runner_ups_taken=1))
    report.results["a"] = {"none": _run("none", 80), "c+linear": _run("c+linear", 80), "c": tree}
    row = report.to_json()["configs"]["c"]["overall"]
    assert row["rows_per_round"] == pytest.approx(3.5)
    assert row["trees"] == {"tree_round_share": 0.25, "tree_drafts": 2, "branches": 3, "runner_ups_taken": 1}
    assert report.to_json()["configs"]["c+linear"]["overall"]["trees"]["tree_round_share"] == 0.0
    lines = [ln for ln in report.table().splitlines() if ln.startswith("c ")]
    assert lines and lines[0].rstrip().endswith("3.5   25%")
