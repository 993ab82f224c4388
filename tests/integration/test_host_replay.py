"""`specray bench --host-replay` on the real model: every configuration's output equals the recorded greedy
output with drafts sent and accepted, the decode stage is the table's wait, and the report says so."""

from __future__ import annotations

import json

import pytest

from specray.bench.host_replay import run_host_replay
from specray.bench.prompts import BenchPrompt
from specray.cli.main import main
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig

from ..conftest import spec_bench_prompts

pytestmark = pytest.mark.model

COPY = ("Repeat the following text exactly, word for word:\n\n" + "The quick brown fox jumps over the lazy dog, "
        "and the lazy dog does not mind at all. Speculative decoding keeps the output the same. " * 3)


def test_replayed_configurations_reproduce_the_recording_at_the_tables_speed(smollm2):
    prompts = [BenchPrompt(category="c", messages=[{"role": "user", "content": q}])
               for q in [COPY, *spec_bench_prompts(2)]]
    cfg = EngineConfig(slots=2, n_ctx=2048, calibrate=False, chain=ChainConfig(speculators=[]))
    engines = []

    def config_engine(c: str) -> LocalEngine:
        chain = [] if c == "none" else c.split(",")
        engines.append(LocalEngine(cfg.model_copy(update={"chain": ChainConfig(speculators=chain)}), model=smollm2))
        return engines[-1]

    engine = LocalEngine(cfg, model=smollm2)
    try:
        table = {1: 2.0, 8: 3.0}
        results = run_host_replay(engine, ["none", "ngram_mod,suffix"], prompts, 48, table, config_engine,
                                  progress=lambda s: None)
    finally:
        engine.close()
    assert [r.config for r in results] == ["none", "ngram_mod,suffix"]
    for r in results:
        assert r.compared == 3 and r.identical == 3, r.config  # the stand-in target replays the recording
        ms = r.stages["ms_per_round"]
        # each round waits the table's time for its rows: 2 ms for one, up to 3 ms for 2-8
        assert 2.0 <= ms["decode"] <= 3.0 + 1.0, (r.config, ms)
        assert 0 < r.stages["host_ms_per_round"] < ms["decode"]
    plain, spec = results
    assert plain.drafted == 0 and spec.drafted > 0  # drafts were sent, verified against the recording, kept
    assert spec.rounds < plain.rounds and spec.tokens == plain.tokens
    assert all(e.scheduler.cost.table()[1] == pytest.approx(0.002, rel=0.3) for e in engines)  # priced by the table


def test_the_command_prints_the_table_and_writes_json_and_a_profile(tmp_path, capsys):
    out, prof = tmp_path / "hr.json", tmp_path / "prof.txt"
    rc = main(["bench", "--host-replay", "1:2,8:3", "--configs", "ngram_mod", "--categories", "coding",
               "--per-category", "1", "--max-tokens", "24", "--n-ctx", "2048", "--json", str(out),
               "--profile", str(prof)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "== host replay" in stdout and "ngram_mod" in stdout
    js = json.loads(out.read_text())["meta"]["host_replay"]
    assert js["decode_ms"] == {"1": 2.0, "8": 3.0}
    assert [r["config"] for r in js["results"]] == ["none", "ngram_mod"]
    assert all(r["identical"] == r["compared"] == 1 for r in js["results"])
    # the profile covers the replayed rounds of each configuration; their decode is the replay's wait (2-3 ms
    # a round by the table, more under the profiler), the rest of the round is the host's
    text = prof.read_text()
    assert "Host replay: the decode is the whole time of ReplayDecode.__call__" in text
    assert " spin" not in text  # the wait is left out of the lists, and so are its perf_counter calls:
    rounds = sum(r["rounds"] for r in js["results"])  # the host's own are a few a round, the wait's thousands
    assert all(int(ln.split()[3]) < 50 * rounds for ln in text.splitlines() if ln.endswith("time.perf_counter>"))
    for r in js["results"]:
        head = next(ln for ln in text.splitlines() if ln.startswith(f"== {r['config']}: "))
        assert f"{r['rounds']} rounds" in head, (head, r["rounds"])
        line = text.splitlines()[text.splitlines().index(head) + 1]
        assert line.startswith("replayed decode: "), line
        decode_ms = float(line.split(", ")[1].split(" ms/round")[0])
        assert 2.0 <= decode_ms <= 6.0, line
    assert "Scheduler.step" in text
    with pytest.raises(SystemExit) as bad:  # refused before any model loads
        main(["bench", "--host-replay", "fast"])
    assert bad.value.code == 2 and "--host-replay 'fast'" in capsys.readouterr().err
