"""Multi-node tests (issue: cluster deployment), on one local Ray cluster of a head and two worker nodes
(tests/cluster/multinode.py, in its own process: the test session's Ray cannot be shared). One run of the
script is shared by every test here:

- placement: each engine replica's router, target and companion share a node, the two replicas are on
  different worker nodes (replica_resources: one `specray_replica` per node), the GPU bundle lands on a GPU
  node, and the app answers;
- a worker removed under 8 greedy streams: every stream ends (finished, or a 503 error event), requests sent
  right after are answered (asked again on the live replica), output is what it was before, and with the node
  back Serve runs 2 replicas again;
- autoscaling 1..2: load brings the second replica up on the other node, quiet takes it away.

Run alone: pytest -m cluster -s (prints how long each step took)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.serve, pytest.mark.model]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def run() -> dict:
    env = dict(os.environ, RAY_ADDRESS="")  # never join the session's Ray
    proc = subprocess.run([sys.executable, str(HERE / "multinode.py")], capture_output=True, text=True,
                          timeout=1500, env=env, cwd=HERE.parents[1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"cluster_start_s"')]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def engines_of(groups: list[list[dict]]) -> list[list[dict]]:
    for g in groups:
        classes = sorted(a["class"] for a in g)
        assert any("TargetService" in c for c in classes) and any("CompanionService" in c for c in classes), classes
        assert len({a["node"] for a in g}) == 1 and g[0]["worker_node"], g  # packed, on a worker (a GPU node)
    return groups


def test_replicas_spread_over_nodes_with_their_actors_packed(run):
    p = run["placement"]
    print(f"\ncluster up {run['cluster_start_s']} s, app deployed {run['deploy_s']} s")
    engines = engines_of(p["groups"])
    assert len(engines) == 2, p["groups"]
    assert engines[0][0]["node"] != engines[1][0]["node"]  # one replica per node
    assert p["status"] == 200 and p["text"], p


def test_a_node_lost_under_load_ends_its_streams_cleanly_and_the_survivor_answers(run):
    n = run["node_loss"]
    outcomes = [s["outcome"] for s in n["streams"]]
    print(f"\nstreams: {outcomes}; requests sent right after the loss answered after {n['right_after_loss']}"
          f" ({n['retried_after_engine_loss']} asked again); streams ended within "
          f"{max(s['ended_after_loss_s'] for s in n['streams'])} s of the loss")
    assert n["reference_ok"] and n["streams_started"] >= 6, n
    assert n["hung"] == 0, n  # nothing hangs
    # a stream on the lost replica ends with a clean 503 error event, never a dropped connection
    assert set(outcomes) <= {"finished", "error"}, n["streams"]
    errors = [s for s in n["streams"] if s["outcome"] == "error"]
    assert errors and all(s["code"] == "engine_unavailable" and s["type"] == "server_error" for s in errors), errors
    assert "finished" in outcomes  # the other replica's streams went on
    assert n["finished_match"], n  # ... with the output the engine gives without a loss (exact mode)
    assert n["right_after_loss"]["statuses"] == [200] * 4 and n["right_after_loss"]["same_output"], n
    assert n["same_output_after_loss"], n.get("outputs")


def test_a_node_added_back_restores_two_replicas(run):
    n = run["node_loss"]
    print(f"\nloss noticed by Serve {n['loss_noticed_s']} s after the new requests; node added in {n['add_node_s']} s,"
          f" 2 replicas again {n['restored_2_replicas_s']} s later")
    assert n["replicas_after_loss"].get("RUNNING") == 1, n["replicas_after_loss"]
    assert n["restored_2_replicas_s"] is not None and n["replicas_restored"] == {"RUNNING": 2}, n
    engines = engines_of(n["groups_restored"])
    assert len(engines) == 2 and engines[0][0]["node"] != engines[1][0]["node"], engines
    assert n["restored_output_ok"], n.get("outputs_restored")


def test_autoscaling_adds_a_replica_on_the_other_node_and_removes_it(run):
    a = run["autoscaling"]
    print(f"\nredeployed with autoscaling in {a['redeploy_s']} s; 1 -> 2 replicas {a['scaled_to_2_s']} s into the "
          f"load, back to 1 {a['back_to_1_s']} s after it")
    assert a["replicas_at_start"] == {"RUNNING": 1}, a
    assert a["scaled_to_2_s"] is not None, a
    engines = engines_of(a["groups_at_2"])
    assert len(engines) == 2 and engines[0][0]["node"] != engines[1][0]["node"], engines
    assert a["back_to_1_s"] is not None, a
    assert a["after_scale_down"]["status"] == 200 and a["after_scale_down"]["text"], a
