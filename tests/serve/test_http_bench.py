"""`specray bench --url/--http`: the HTTP bench path for real, tiny (both modes + in-process, 8 tokens)."""

from __future__ import annotations

import json

import pytest

from specray.cli import main as cli
from specray.bench.http_compare import (compare, deployed, engine_config, select_prompts, serve_configs,
                                                     table)
from specray.bench.stages import STAGES
from specray.engine.config import EngineConfig

from .conftest import ENGINE, concurrent_prompts

MAX_TOKENS = 8
STREAMS = [1, 3]


@pytest.mark.serve
@pytest.mark.model
def test_http_bench_both_modes_and_in_process(ray_serve, tmp_path):
    from specray.deployments.local_engine import LocalEngine

    ecfg = EngineConfig.model_validate(ENGINE)  # exact: every mode must produce the same greedy tokens
    prompts = [{"messages": [{"role": "user", "content": p}]} for p in concurrent_prompts()[:3]]
    with deployed(ray_serve, serve_configs(ecfg, ["colocated", "distributed"])) as urls:
        engine = LocalEngine(ecfg)
        try:
            report = compare([urls["colocated"], urls["distributed"]], prompts, STREAMS, MAX_TOKENS, engine)
        finally:
            engine.close()
        print("\n" + table(report))
        assert "stages: colocated, 3 streams" in table(report) and "stages: in-process" not in table(report)

        # the CLI's --url path against a running app, JSON included
        out = tmp_path / "url.json"
        rc = cli.main(["bench", "--url", urls["distributed"], "--no-in-process", "--streams", "2",
                       "--num-prompts", "2", "--max-tokens", str(MAX_TOKENS), "--json", str(out)])
    assert rc == 0
    js = json.loads(out.read_text())
    assert [t["mode"] for t in js["targets"]] == ["distributed"] and js["targets"][0]["slots"] == ENGINE["slots"]
    (row,) = js["rows"]
    assert row["label"] == "distributed" and row["streams"] == 2 and row["requests"] == 2 and row["n_errors"] == 0
    assert 0 < row["completion_tokens"] <= 2 * MAX_TOKENS and row["tokens_per_s"] > 0
    assert row["vs_colocated"] is None and js["summary"]["distributed_vs_colocated"] == {"2": None}
    assert js["meta"]["max_tokens"] == MAX_TOKENS and js["meta"]["streams"] == [2]
    # no in-process engine: the header's chain and slots are the server's own, as it reported them
    assert (js["meta"]["chain"], js["meta"]["slots"]) == (js["targets"][0]["chain"], ENGINE["slots"])
    assert js["meta"]["chain"] == EngineConfig.model_validate(ENGINE).chain.label
    st = row["stages"]  # every request asked for its per-stage timing (X-Specray-Timing)
    assert st["requests"] == 2 and all(st[k]["mean"] >= 0 and st[k]["p50_per_token"] >= 0 for k in STAGES)
    assert sum(st[k]["mean"] for k in STAGES) == pytest.approx(st["total"]["mean"], abs=0.01)
    assert st["total"]["mean"] <= 1000 * row["mean_latency_s"] + 1  # to the final chunk, not past [DONE]
    assert st["per_chunk"]["emit_chunks"] >= 1 and st["per_chunk"]["sse_chunks"] == st["per_chunk"]["emit_chunks"]

    rows = report["rows"]
    assert [(r["label"], r["streams"]) for r in rows] == [
        (m, c) for c in STREAMS for m in ("in-process", "colocated", "distributed")]
    tokens = {r["completion_tokens"] for r in rows}
    assert len(tokens) == 1, "exact greedy: every mode and stream count generates the same tokens"
    assert 0 < tokens.pop() <= len(prompts) * MAX_TOKENS
    for r in rows:
        assert r["requests"] == len(prompts) and r["n_errors"] == 0, r["errors"]
        assert (r["stages"] is None) == (r["mode"] == "in-process")
        assert r["tokens_per_s"] == pytest.approx(r["completion_tokens"] / r["seconds"], rel=0.02)
        assert r["rounds"] >= len(prompts) and r["mean_ttft_ms"] > 0
        if r["streams"] == 1:  # one request at a time: every target decode holds one sequence
            assert r["mean_seqs_per_decode"] == 1.0 and r["multi_seq_decodes"] == 0
        else:  # 3 streams share decodes (the counters come from the target itself, actor or in-process)
            assert 1.0 < r["mean_seqs_per_decode"] <= 3 and r["multi_seq_decodes"] > 0
        if r["mode"] == "distributed":
            hop = r["hop"]
            assert hop["calls"] >= r["rounds"] and hop["percentiles_of_last"] == hop["calls"]
            assert 0 < hop["p50_ms"] <= hop["p95_ms"] and hop["mean_ms"] > 0
        else:
            assert "hop" not in r
        if r["mode"] == "in-process":
            assert "server_cpu" not in r
        else:  # the servers run on this machine: their processes' CPU per token, llama.cpp's named threads apart
            cpu = r["server_cpu"]
            assert cpu["decode_ms_per_token"] > 0 and cpu["other_ms_per_token"] >= 0
            assert cpu["processes"] >= (2 if r["mode"] == "distributed" else 1)  # + the target actor
            # Ray's own processes beside them: at least the GCS, the raylet and the Serve controller
            assert cpu["ray_processes"] >= 3 and cpu["ray_ms_per_token"] >= 0
        assert r["vs_colocated"] > 0 and r["vs_in_process"] > 0
        if r["mode"] == "colocated":
            assert r["vs_colocated"] == 1.0
        if r["mode"] == "in-process":
            assert r["vs_in_process"] == 1.0
    ratios = report["summary"]["distributed_vs_colocated"]
    assert set(ratios) == {"1", "3"} and all(v > 0 for v in ratios.values())
    assert report["summary"]["at_streams"] == 3 and isinstance(report["summary"]["met"], bool)


def test_select_prompts_round_robin_over_categories():
    from specray.bench.run import default_prompts_path

    ps = select_prompts(default_prompts_path(), None, 3, 8)
    assert len(ps) == 8 and all(p["messages"][0]["role"] == "user" for p in ps)
    assert len({p["messages"][0]["content"] for p in ps}) == 8
    from specray.bench.run import load_prompts

    cats = {bp.messages[0]["content"]: bp.category for bp in load_prompts(default_prompts_path(), None, 3)}
    assert len({cats[p["messages"][0]["content"]] for p in ps}) == 8  # 13 categories: 8 different ones


@pytest.mark.parametrize("argv, message", [
    (["--http", "--configs", "none"], "use --spec"),
    (["--url", "http://127.0.0.1:1", "--http"], "give one of them"),
    (["--streams", "2"], "--streams needs --url or --http"),
    (["--no-in-process"], "--no-in-process needs --url or --http"),
    (["--http", "--serve-modes", "sideways"], "--serve-modes"),
    (["--http", "--repeats", "2"], "--repeats is for the in-process bench"),
    (["--http", "--order", "alternate"], "--order is for the in-process bench"),
])
def test_bench_http_flag_errors(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_bench_order_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--order", "random"])
    assert "--order: invalid choice: 'random' (choose from" in capsys.readouterr().err


def test_bench_streams_must_be_positive():
    with pytest.raises(SystemExit):
        cli.main(["bench", "--http", "--streams", "1", "0"])


def test_http_bench_engines_get_the_engine_flags():
    args = cli.build_parser().parse_args(["bench", "--http", "--flash-attn", "--threads", "1"])
    ecfg = engine_config(args, slots=3, chain_label="suffix")
    assert (ecfg.flash_attn, ecfg.threads, ecfg.slots, ecfg.chain.speculators) == (True, 1, 3, ["suffix"])
    default = engine_config(cli.build_parser().parse_args(["bench", "--http"]), 1, None)
    assert default.flash_attn is None and default.flash_attn_on  # on unless exact mode
    off = engine_config(cli.build_parser().parse_args(["bench", "--http", "--no-flash-attn"]), 1, None)
    assert off.flash_attn is False and not off.flash_attn_on
