"""`specray bench` for real but tiny: the JSON contract other tools read, and its figures add up."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from specray.bench.run import BenchPrompt, load_prompts, run_bench, write_json
from specray.cli.main import main
from specray.native.context import Context, n_ctx_for_seq


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
    assert js["meta"]["flash_attn"] is True  # on by default outside exact mode (EngineConfig.flash_attn_on)


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
    lines: list[str] = []
    report = run_bench(model="smollm2-135m", configs=["suffix"], prompts=prompts, max_tokens=48, slots=1,
                       exact=False, policy="cost", n_max=8, threads=2, n_ctx=1024, progress=lines.append,
                       llama_baseline=False, repeats=2, order="sandwich", progress_every=0.0)
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
    # progress after every round (progress_every=0): a prompt run is one of the three runs of a pass
    # (none, suffix, none), counted as each finishes; the category's end says all 6
    counts = _progress_counts(lines)
    assert [c[0] for c in counts] == sorted(c[0] for c in counts) and counts[-1] == (6, 6, "chat")
    assert {c[2] for c in counts} == {"chat, pass 1/2", "chat, pass 2/2", "chat"}
    assert {c[0] for c in counts} == set(range(6 + 1)), lines


# ~1,000 tokens in a chat message: the first prompt of the file, so the tie-bound probes start from it
LONG_PROMPT = " ".join(f"Note {i}: the harbour master logged ship {i * 7 % 101} arriving at berth {i % 13} with "
                       f"{i * 3 % 17} crates of tea." for i in range(36)) + "\nWhich berth did ship 98 use?"


@pytest.fixture(scope="module")
def long_first_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "long_first.jsonl"
    rows = [{"category": "long", "messages": [{"role": "user", "content": LONG_PROMPT}]},
            {"category": "short", "messages": [{"role": "user", "content": "Name three primary colors."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _progress_counts(lines: list[str]) -> list[tuple[int, int, str]]:
    """(done, total, where) of each progress line."""
    out = []
    for line in lines:
        m = re.fullmatch(r"bench: (\d+)/(\d+) prompt runs \(\d+%\), elapsed \d+:\d\d, ETA (?:\?|[\d:]+) \[(.+)\]",
                         line)
        if m:
            out.append((int(m[1]), int(m[2]), m[3]))
    return out


def test_a_long_first_prompt_is_benched(long_first_file, smollm2):
    # longer than n_batch (512) once tiled, so the probes' prefix cannot be one decode
    assert len(smollm2.chat_tokens([{"role": "user", "content": LONG_PROMPT}])) > 900
    prompts = load_prompts(str(long_first_file), None, None)
    lines: list[str] = []
    report = run_bench(model="smollm2-135m", configs=["ngram_simple"], prompts=prompts, max_tokens=8, slots=2,
                       exact=False, policy="cost", n_max=8, threads=2, n_ctx=2048, progress=lines.append,
                       llama_baseline=False, progress_every=0.0)
    # the probes measured a drift (llamafile's sgemm is not batch-invariant) and the bound covers it
    assert report.batch_variance > 0.0 and report.layout_variance >= 0.0
    assert report.tie_bound == 2.0 * max(report.batch_variance, report.layout_variance)
    for cat in ("long", "short"):
        assert report.results[cat]["none"].tokens > 0 and report.results[cat]["ngram_simple"].compared == 1
    # progress: 2 prompts x 2 configurations, in lockstep; with progress_every=0 a line after every round,
    # counting each configuration's prompt as it finishes, and one at the end of each category
    counts = _progress_counts(lines)
    assert [c[0] for c in counts] == sorted(c[0] for c in counts), lines
    assert counts[0] == (0, 4, "long") and (2, 4, "long") in counts and counts[-1] == (4, 4, "short")
    assert len(counts) > 4  # the rounds' lines, not only the categories'
    assert lines[-3].endswith("ETA 0:00 [short]")


def test_cli_bench_on_a_long_first_prompt(long_first_file, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--prompts", str(long_first_file), "--configs", "ngram_simple", "--max-tokens", "8",
               "--slots", "2", "--n-ctx", "2048", "--no-llama-baseline", "--json", str(out_json),
               "--plot", str(out_png)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    js = json.loads(out_json.read_text())
    assert set(js["configs"]["ngram_simple"]["categories"]) == {"long", "short"}
    # the table on stdout, progress on stderr, ending with every prompt run done
    assert "== long ==" in out and "bench:" not in out
    counts = _progress_counts(err.splitlines())
    assert counts and counts[-1] == (4, 4, "short"), err
    assert out_png.read_bytes()[:4] == b"\x89PNG" and f"plot: {out_png}" in err


@pytest.mark.parametrize("order", ["lockstep", "alternate"])
def test_verify_shape_both_runs_each_chain_both_ways_losslessly(order):
    # exact mode: the bucketed run of a chain must give the very tokens of `none`, as its exact-shape run does
    prompts = [BenchPrompt("copy", prompt="a b c d e f g a b c d e f g a b c d e f g a b c")]
    rep = run_bench(model="smollm2-135m", configs=["suffix"], prompts=prompts, max_tokens=24, slots=1, exact=True,
                    policy="cost", n_max=8, threads=2, n_ctx=1024, progress=lambda s: None, llama_baseline=False,
                    order=order, verify_shape="both")
    assert rep.configs == ["none", "suffix", "suffix@bucketed"] and rep.meta["verify_shape"] == "both"
    for c in ("suffix", "suffix@bucketed"):
        r = rep.results["copy"][c]
        assert r.identical == r.compared == 1 and r.accepted > 0, c


# --exact with 2 slots and --n-ctx 1024: each sequence has its own KV stream of 512 cells, too few for
# LONG_PROMPT (~1,000 tokens); the two short prompts fit
SKIP_ARGS = ["--configs", "ngram_simple", "--max-tokens", "8", "--slots", "2", "--exact", "--n-ctx", "1024",
             "--no-llama-baseline"]


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a `specray` command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory):
    """One short exact-mode CLI run with an over-long prompt, profiled: (stdout, stderr, JSON, profile text)."""
    d = tmp_path_factory.mktemp("skip")
    prompts = _write_jsonl(d / "p.jsonl", [
        {"question_id": "long-1", "category": "long", "turns": [LONG_PROMPT]},
        {"question_id": 7, "category": "short", "turns": ["Name three primary colors."]},
        {"category": "short", "prompt": "The capital of France is"}])
    rc, out, err = _cli(["bench", "--prompts", prompts, *SKIP_ARGS, "--json", str(d / "b.json"),
                         "--profile", str(d / "profile.txt")])
    assert rc == 0, err
    return out, err, json.loads((d / "b.json").read_text()), (d / "profile.txt").read_text()


def test_cli_bench_skips_a_prompt_too_long_for_its_slot(skip_run, smollm2):
    out, err, js, _ = skip_run
    meta = js["meta"]
    assert meta["n_ctx_seq"] == 512 and meta["skipped_prompts"] == 1
    [skipped] = meta["skipped"]
    assert skipped["prompt"] == "long/long-1" and skipped["cells"] > 900
    # the --n-ctx it suggests is the smallest that gives 2 exact-mode streams room for it, as llama.cpp sizes them
    n_ctx = meta["n_ctx_fitting_all"]
    for n, fits in ((n_ctx, True), (n_ctx - 2 * 256, False)):
        ctx = Context(smollm2, n_ctx=n, n_seq_max=2, n_batch=64, exact=True)
        try:
            assert (ctx.n_ctx_seq >= skipped["cells"]) == fits, (n, ctx.n_ctx_seq)
        finally:
            ctx.close()
    # one line before the run names it and the fix; the run went on with the others, and the table says so
    assert (f"bench: skipping 1 of 3 prompts too long for the context (512 cells per sequence: --n-ctx 1024 split "
            f"over 2 slots, one KV stream each (--exact)): long/long-1 ({skipped['cells']} cells); --n-ctx {n_ctx} "
            "fits them all") in err.splitlines()
    row = js["configs"]["ngram_simple"]
    assert set(row["categories"]) == {"short"} and row["compared"] == 2 and row["mismatches"] == 0
    assert f"skipped 1 prompt too long for 512 cells per sequence (long/long-1); --n-ctx {n_ctx}" in out


def test_cli_bench_refuses_when_no_prompt_fits(tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"category": "long", "turns": [LONG_PROMPT]}])
    rc, out, err = _cli(["bench", "--prompts", prompts, *SKIP_ARGS])
    assert rc == 2 and out == ""
    m = re.search(r"^specray bench: error: every prompt \(1\) is too long for the context \(512 cells per "
                  r"sequence: .*\): long#1 \((\d+) cells\); --n-ctx (\d+) fits them all$", err, re.M)
    assert m and int(m[2]) == n_ctx_for_seq(int(m[1]), 2, kv_unified=False), err


def test_cli_bench_profile_shows_where_a_round_goes(skip_run):
    _, err, js, text = skip_run
    assert "profile: " in err and js["meta"]["profiled"] is True
    # a row per configuration: rounds, seconds, ms per round = llama_decode's + the host's
    for cfg in ("none", "ngram_simple"):
        m = re.search(rf"^{cfg} +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$", text, re.M)
        assert m, text
        rounds, ms, decode_ms, host_ms = int(m[1]), float(m[3]), float(m[4]), float(m[5])
        assert rounds > 0 and decode_ms > 0 and host_ms > 0
        assert abs(ms - decode_ms - host_ms) < 0.02
        # a CPU decode of SmolLM2 costs far more than the round's host work, profiled or not: the decode's time
        # is found (it is the own time of the one function that calls llama_decode)
        assert decode_ms > host_ms, (cfg, decode_ms, host_ms)
    # the round function and the decode call, by name; the round covers nearly all of the profiled time
    assert "Context.launch" in text and "llama_decode" in text
    step = [ln for ln in text.splitlines() if ln.endswith(" Scheduler.step")]
    assert step and max(float(ln.split()[1]) for ln in step) > 90.0, step


def test_parameter_variants_and_a_tuned_configuration():
    """bench/variants.py: a configuration with its own parameters runs with them, `+tune` tunes from the
    --spec-param start, and the report says what tuning ended on."""
    prompts = [BenchPrompt("copy", prompt="Repeat after me: one two three four five, one two three four five, "
                                          "one two three four five, one two")]
    lines: list[str] = []
    report = run_bench(model="smollm2-135m", configs=["suffix+tune", "suffix/suffix.min_match=2"], prompts=prompts,
                       max_tokens=24, slots=1, exact=False, policy="cost", n_max=8, threads=2, n_ctx=1024,
                       progress=lines.append, llama_baseline=False, spec_params={"suffix": {"min_match": 16}},
                       repeats=2)
    assert report.configs == ["none", "suffix+tune", "suffix/suffix.min_match=2"]
    assert report.results["copy"]["suffix/suffix.min_match=2"].tokens > 0
    tuning = report.meta["tuning"]["suffix+tune"][-1]  # the last of the two passes
    settings = tuning["suffix"]["default"]["settings"]
    assert settings[0]["params"]["min_match"] == 16  # the start: --spec-param's
    assert sum(s["rounds"] for s in settings) > 0
    assert any(line.startswith("suffix+tune: suffix [default] tuned to") for line in lines), lines
    # each pass: the tuned run against the fixed setting that won the other pass
    held = report.meta["tuning_held_out"]["suffix+tune"]
    assert [w["pass"] for w in held] == [1, 2] and {w["winner"] for w in held} == {"suffix/suffix.min_match=2"}
    sp = report.repeat_speedups("suffix+tune", report.categories)
    assert [w["tuned_speedup"] for w in held] == [round(x, 3) for x in sp]
