"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster), run as its own process by
tests/cluster/test_multinode.py (it cannot share the test session's Ray): a head (the ingress, no engine
replica) and two worker nodes, each with one `specray_replica` and one logical GPU; cluster/serve-cluster.yaml's
app with a small engine and the target actor on the GPU. Three phases on the one cluster:

1. placement: where every actor of every replica runs, and a request's answer;
2. node loss: 8 greedy streams, one worker removed under them (ungracefully: its raylet killed); how each
   stream ended, how long until new requests succeed and whether their output is what it was, then a node added
   back and how long Serve takes to run 2 replicas again;
3. autoscaling: the app redeployed with autoscaling 1..2; load until a second replica runs (on which node),
   then quiet until it is back to 1.

Prints one JSON line with what it found and how long each step took.

    .venv/bin/python tests/cluster/multinode.py
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
WORKER = {"num_cpus": 2, "num_gpus": 1, "resources": {"specray_replica": 1}}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three primary colors:", "Water boils at", "The largest planet in the solar system is",
           "Translate 'good morning' into Spanish:", "A short story about a robot:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _since(t: float) -> float:
    return round(time.perf_counter() - t, 1)


class Client:
    """The app's HTTP endpoint: greedy completions, streamed or not."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"

    def complete(self, prompt: str, max_tokens: int = 16) -> tuple[int, str]:
        import httpx

        r = httpx.post(self.url, timeout=120, json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url.replace("/completions", "/stats"), timeout=60).json()

    def complete_until_ok(self, prompt: str, limit_s: float) -> tuple[str | None, int]:
        """Asks again on 503 (a replica gone or not yet there) until it answers; (text, tries)."""
        t0, tries = time.perf_counter(), 0
        while time.perf_counter() - t0 < limit_s:
            tries += 1
            try:
                status, text = self.complete(prompt)
            except Exception:  # a connection the proxy dropped while the node went away
                status, text = 0, ""
            if status == 200:
                return text, tries
            time.sleep(0.5)
        return None, tries

    def stream(self, prompt: str, max_tokens: int, out: dict) -> None:
        """One streamed request; `out` gets how it ended: finished (finish_reason), error (the error event's
        status and code, or the HTTP status) or broken (the connection), and when."""
        import httpx

        t0 = time.perf_counter()
        out.update(prompt=prompt, text="", chunks=0)
        try:
            with httpx.stream("POST", self.url, timeout=httpx.Timeout(120, connect=10),
                              json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                    "stream": True}) as r:
                if r.status_code != 200:
                    out.update(outcome="error", status=r.status_code)
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        err = obj["error"]
                        out.update(outcome="error", type=err.get("type"), code=err.get("code"),
                                   message=(err.get("message") or "")[:200])
                        return
                    choice = obj["choices"][0]
                    out["text"] += choice.get("text", "")
                    out["chunks"] += 1
                    out.setdefault("first_chunk_s", time.perf_counter() - t0)
                    if choice.get("finish_reason"):
                        out.update(outcome="finished", finish_reason=choice["finish_reason"])
            out.setdefault("outcome", "broken")  # the body ended without a finish or an error
        except Exception as e:
            out.update(outcome="broken", exception=type(e).__name__)
        finally:
            out["ended_at"] = time.perf_counter()


def engine_deployment() -> tuple[str, dict]:
    """(the engine deployment's name, its replica counts by state) from serve.status()."""
    from ray import serve

    deps = serve.status().applications["specray"].deployments
    name = next(n for n in deps if n != "Ingress")
    return name, {str(k): v for k, v in deps[name].replica_states.items()}


def wait_replicas(n: int, limit_s: float, below: bool = False) -> float | None:
    """Seconds until the engine deployment runs exactly n replicas (below: fewer than n running), from
    serve.status(); None: not within limit_s."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        states = engine_deployment()[1]
        running = states.get("RUNNING", 0)
        if (running < n) if below else (running == n and sum(states.values()) == n):
            return _since(t0)
        time.sleep(0.5)
    return None


def engine_groups(worker_ids: set[str]) -> list[list[dict]]:
    """The live engine replicas' placement groups: every actor in one, with its node."""
    from ray.util.state import list_actors

    groups: dict[str, list] = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10_000):
        if a.placement_group_id:
            groups.setdefault(a.placement_group_id, []).append(
                {"class": a.class_name, "node": a.node_id, "worker_node": a.node_id in worker_ids})
    return [g for g in groups.values() if any("Replica" in a["class"] for a in g)]


def placement(client: Client, worker_ids: set[str]) -> dict:
    status, text = client.complete("The capital of France is", 8)
    return {"groups": engine_groups(worker_ids), "status": status, "text": text}


def node_loss(cluster, client: Client, workers: list) -> dict:
    """8 streams, a worker removed under them, new requests, the node back."""
    out: dict = {}
    refs = [client.complete(p) for p in PROMPTS[:4]]
    out["reference_ok"] = all(s == 200 for s, _ in refs)
    streams = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=client.stream, args=(p, 96, s), daemon=True) for p, s in zip(PROMPTS, streams)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 60 and sum("first_chunk_s" in s for s in streams) < 6:
        time.sleep(0.1)  # most streams under way before the node goes
    out["streams_started"] = sum("first_chunk_s" in s for s in streams)
    lost = workers.pop(0)
    t_loss = time.perf_counter()
    cluster.remove_node(lost, allow_graceful=False)
    out["remove_node_s"] = _since(t_loss)
    # requests sent right after the loss, before Serve has noticed it: the ingress asks again what a lost
    # replica took (engine_link.RetryingStream / HandleEngine.generate), so they should all be answered
    quick: list = [None] * 4

    def one(i: int) -> None:
        try:
            quick[i] = client.complete(PROMPTS[i])
        except Exception as e:
            quick[i] = (0, type(e).__name__)

    quick_threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
    for t in quick_threads:
        t.start()
    for t in threads + quick_threads:
        t.join(timeout=240)
    out["right_after_loss"] = {"statuses": [q[0] if q else None for q in quick],
                               "same_output": [q for q in quick] == refs, "answered_s": _since(t_loss)}
    out["retried_after_engine_loss"] = client.stats()["ingress"]["retried_after_engine_loss"]
    out["hung"] = sum(t.is_alive() for t in threads + quick_threads)
    out["streams"] = [{k: v for k, v in s.items() if k not in ("text", "ended_at")}
                      | {"ended_after_loss_s": round(s["ended_at"] - t_loss, 1) if "ended_at" in s else None}
                      for s in streams]
    ref_of = dict(zip(PROMPTS, (t for _, t in refs)))
    # a stream that finished says what the engine says without the loss (exact mode: batch-invariant)
    out["finished_match"] = all(s["text"].startswith(ref_of[s["prompt"]]) for s in streams
                                if s.get("outcome") == "finished" and s["prompt"] in ref_of)
    t_new = time.perf_counter()
    first_text, tries = client.complete_until_ok(PROMPTS[0], 120)
    out["first_success_after_loss_s"] = round(time.perf_counter() - t_loss, 1)
    out["first_success_tries"] = tries
    after = [first_text] + [client.complete_until_ok(p, 60)[0] for p in PROMPTS[1:4]]
    out["new_requests_s"] = _since(t_new)
    out["same_output_after_loss"] = after == [t for _, t in refs]
    if not out["same_output_after_loss"]:
        out["outputs"] = {"before": [t for _, t in refs], "after": after}
    # Serve's controller notices the lost replica (its actor died with the node) before a node comes back
    out["loss_noticed_s"] = wait_replicas(2, 120, below=True)
    out["replicas_after_loss"] = engine_deployment()[1]
    t_add = time.perf_counter()
    workers.append(cluster.add_node(**WORKER))
    out["add_node_s"] = _since(t_add)
    out["restored_2_replicas_s"] = wait_replicas(2, 240)
    out["replicas_restored"] = engine_deployment()[1]
    out["groups_restored"] = engine_groups({w.node_id for w in workers})
    restored = [client.complete(p) for p in PROMPTS[:4]]
    out["restored_output_ok"] = restored == refs
    if not out["restored_output_ok"]:
        out["outputs_restored"] = restored
    return out


def autoscaling(args: dict, client: Client, workers: list, port: int) -> dict:
    """Redeployed with autoscaling 1..2: load brings a second replica (on the other node), quiet takes it away."""
    from ray import serve

    from specray.deployments.app import build_app

    out: dict = {}
    t0 = time.perf_counter()
    args = dict(args, autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                   "upscale_delay_s": 1, "downscale_delay_s": 4, "metrics_interval_s": 0.5,
                                   "look_back_period_s": 2})
    args.pop("num_replicas", None)
    serve.run(build_app(args), name="specray", route_prefix="/")
    out["redeploy_s"] = _since(t0)
    out["replicas_at_start"] = engine_deployment()[1]
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            client.stream(PROMPTS[i % len(PROMPTS)], 48, {})

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(8)]
    t_load = time.perf_counter()
    for t in threads:
        t.start()
    out["scaled_to_2_s"] = wait_replicas(2, 240)
    out["groups_at_2"] = engine_groups({w.node_id for w in workers})
    stop.set()
    for t in threads:
        t.join(timeout=180)
    out["load_s"] = _since(t_load)
    t_quiet = time.perf_counter()
    out["back_to_1_s"] = wait_replicas(1, 240)
    out["quiet_s"] = _since(t_quiet)
    status, text = client.complete(PROMPTS[0])
    out["after_scale_down"] = {"status": status, "text": text}
    return out


def main() -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from specray.deployments.app import build_app

    t0 = time.perf_counter()
    # a lost node is noticed in ~3 s, not Ray's default ~30 s: the test waits for it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                                           "health_check_initial_delay_ms": 1000}})
    workers = [cluster.add_node(**WORKER) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = _free_port()
    # one HTTP proxy, on the head: every node of this cluster has the same address, and the client must reach
    # a proxy that outlives the worker it removes (on a real cluster a load balancer spreads over the nodes'
    # proxies, and a lost node's proxy takes its own connections with it)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    doc = yaml.safe_load((REPO / "cluster" / "serve-cluster.yaml").read_text())
    args = doc["applications"][0]["args"]
    # exact mode: greedy output does not depend on what else shares the batch, so outputs before, during and
    # after the loss compare token for token
    args["engine"] |= {"n_ctx": 2048, "slots": 4, "threads": 1, "calibrate": False, "exact": True}
    args |= {"replica_cpus": 0.25, "target_cpus": 0.5, "companion_cpus": 0.25, "ingress_cpus": 0.1,
             "target_gpus": 1}
    out: dict = {"cluster_start_s": _since(t0)}
    client = Client(port)
    t1 = time.perf_counter()
    try:
        serve.run(build_app(args), name="specray", route_prefix="/")
        out["deploy_s"] = _since(t1)
        out["placement"] = placement(client, {w.node_id for w in workers})
        phases = sys.argv[1:] or ["node_loss", "autoscaling"]
        if "node_loss" in phases:
            out["node_loss"] = node_loss(cluster, client, workers)
        if "autoscaling" in phases:
            out["autoscaling"] = autoscaling(args, client, workers, port)
    finally:
        print(json.dumps(out), flush=True)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
