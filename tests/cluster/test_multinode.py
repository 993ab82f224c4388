"""Multi-node placement (issue: cluster deployment): on a head and two worker nodes of one local Ray cluster,
each engine replica's router, target and companion share a node, the two replicas are on different worker
nodes (replica_resources: one `specray_replica` per node), the GPU bundle lands on a GPU node, and the app
answers. Runs tests/cluster/multinode.py in its own process (the test session's Ray cannot be shared).
Run alone: pytest -m cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.serve, pytest.mark.model]

HERE = Path(__file__).resolve().parent


def test_replicas_spread_over_nodes_with_their_actors_packed():
    env = dict(os.environ, RAY_ADDRESS="")  # never join the session's Ray
    proc = subprocess.run([sys.executable, str(HERE / "multinode.py")], capture_output=True, text=True,
                          timeout=900, env=env, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\ncluster up {out['cluster_start_s']} s, app deployed {out['deploy_s']} s")
    engines = [g for g in out["groups"] if any("Replica" in a["class"] for a in g)]
    assert len(engines) == 2, out["groups"]
    for g in engines:
        classes = sorted(a["class"] for a in g)
        assert any("TargetService" in c for c in classes) and any("CompanionService" in c for c in classes), classes
        assert len({a["node"] for a in g}) == 1 and g[0]["worker_node"], g  # packed, on a worker (a GPU node)
    assert engines[0][0]["node"] != engines[1][0]["node"]  # one replica per node
    assert out["status"] == 200 and out["text"], out
