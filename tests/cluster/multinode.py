"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster), run as its own process by
tests/cluster/test_multinode.py (it cannot share the test session's Ray): a head without engine replicas and
two worker nodes, each with one `specray_replica` and one logical GPU; cluster/serve-cluster.yaml's app with a
small engine and the target actor on the GPU. Prints one JSON line of what it found: where every actor of
every replica runs, and a request's answer.

    python -m specray.tests.cluster.multinode      # (from the repo: python tests/cluster/multinode.py)
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from specray.deployments.app import build_app

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=2, num_gpus=1, resources={"specray_replica": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    doc = yaml.safe_load((REPO / "cluster" / "serve-cluster.yaml").read_text())
    args = doc["applications"][0]["args"]
    args["engine"] |= {"n_ctx": 1024, "slots": 2, "threads": 1, "calibrate": False}
    args |= {"replica_cpus": 0.25, "target_cpus": 0.5, "companion_cpus": 0.25, "ingress_cpus": 0.1,
             "target_gpus": 1}
    out: dict = {"cluster_start_s": round(time.perf_counter() - t0, 1)}
    t1 = time.perf_counter()
    try:
        serve.run(build_app(args), name="specray", route_prefix="/")
        out["deploy_s"] = round(time.perf_counter() - t1, 1)
        worker_ids = {w.node_id for w in workers}
        actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True)]
        groups: dict[str, list] = {}
        for a in actors:
            if a.placement_group_id:
                groups.setdefault(a.placement_group_id, []).append(
                    {"class": a.class_name, "node": a.node_id, "worker_node": a.node_id in worker_ids})
        out["groups"] = list(groups.values())
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        out["status"], out["text"] = r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
