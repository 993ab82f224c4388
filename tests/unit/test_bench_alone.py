"""scripts/bench-alone.sh's argument checks (before it starts anything) and its report (bench/alone_report.py).

The servers' part of the script is a measurement run (a llama-server build, minutes a pass): not in the suite.
"""

from __future__ import annotations

import doctest
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from specray.bench import alone_report

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench-alone.sh"


def _bench_json(rows: list[tuple[int, float]]) -> str:
    """The parts of a `specray bench --url --json` file the report reads, in that file's shape."""
    return json.dumps({"kind": "http", "rows": [{"label": "x", "streams": s, "tokens_per_s": t} for s, t in rows]})


def test_doctests():
    failed, attempted = doctest.testmod(alone_report)
    assert attempted >= 4 and failed == 0


def test_report_takes_ratios_within_each_pass_and_writes_the_summary(tmp_path, capsys):
    for n, ours, theirs in ((1, [(1, 70.0), (4, 120.0)], [(1, 80.0), (4, 100.0)]),
                            (2, [(1, 66.0), (4, 110.0)], [(1, 60.0), (4, 110.0)])):
        (tmp_path / f"specray-{n}.json").write_text(_bench_json(ours))
        (tmp_path / f"llama-server-{n}.json").write_text(_bench_json(theirs))
    assert alone_report.main([str(tmp_path), "--passes", "2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["ratio"] for r in summary["rows"]] == [0.875, 1.2, 1.1, 1.0]
    assert summary["median_ratio"] == {"1": 0.988, "4": 1.1}
    out = capsys.readouterr().out
    assert "median ratio: 1 streams 0.988x, 4 streams 1.100x" in out


def test_report_names_the_pass_that_did_not_finish(tmp_path, capsys):
    (tmp_path / "specray-1.json").write_text(_bench_json([(1, 70.0)]))
    assert alone_report.main([str(tmp_path), "--passes", "1"]) == 2
    assert "llama-server-1.json: pass 1 of llama-server did not finish" in capsys.readouterr().err


def _run(tmp_path, **env):
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=os.environ | env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("env, message", [
    ({"PASSES": "two"}, "PASSES must be a positive number, got 'two'"),
    ({"STREAMS": "1,4"}, "STREAMS must be positive numbers, got '1,4'"),
    ({"MODEL": "no-such-model"}, "MODEL 'no-such-model' does not resolve to a GGUF"),
])
def test_script_refuses_bad_settings_before_starting_anything(tmp_path, env, message):
    r = _run(tmp_path, PORT="1", LLAMA_PORT="2", **env)
    assert r.returncode == 2 and f"bench-alone: {message}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_script_refuses_a_port_that_answers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        port = s.getsockname()[1]
        r = _run(tmp_path, PORT=str(port), LLAMA_PORT="2")
    assert r.returncode == 2 and f"something already listens on port {port}" in r.stderr, r.stderr


def test_script_usage_without_an_out_dir():
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Usage: bash scripts/bench-alone.sh OUT_DIR" in r.stderr
