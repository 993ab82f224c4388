"""`specray bench`'s report without a model: the run order, speedups against each configuration's own `none`
neighbours, and which speculator of a chain carried it."""

from __future__ import annotations

import doctest

import pytest

from specray.deployments import bench_order
from specray.deployments.bench import (BenchReport, ConfigResult, _compare, _run_lockstep, classify_divergence,
                                       divergence_margin)
from specray.deployments.bench_order import baseline_positions, reversed_turn, run_order
from specray.engine.request import SpecCounters


def test_docstring_examples():
    failed, attempted = doctest.testmod(bench_order)
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
