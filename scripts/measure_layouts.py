"""Serving layouts side by side (docs/serving.md): wall tok/s and the request path's CPU per token.

Starts a local Ray + Serve (TMPDIR decides its session dir; Linux, reads /proc), deploys the app in both
layouts (fused, split) on one Serve instance, loads the in-process engine with the served engine's config
(threads included), then for each round and each stream count (1, 4) runs every target in turn, the order
rotated each round: 8 Spec-Bench prompts x 128 tokens through specray bench's own HTTP client and in-process
runner. With `direct`, Ray Serve's direct ingress is on, so each app is measured through the proxy and
directly (its ingress replica's own port). Per run: aggregate tok/s and the CPU time (utime + stime) each
process of this tree spent; the summary gives per target the median tok/s and the CPU per token of the
request path (engine replica, Ingress, proxy; in-process: the engine) and its excess over the in-process
engine's in the same round.

usage: .venv/bin/python scripts/measure_layouts.py OUT.json ROUNDS CHAIN [direct]
       .venv/bin/python scripts/measure_layouts.py --summary OUT.json
e.g.   TMPDIR=/tmp/my-ray .venv/bin/python scripts/measure_layouts.py layouts.json 2 none direct
"""

import json
import os
import sys
import time

os.environ.setdefault("RAY_ADDRESS", "")
DIRECT = len(sys.argv) > 4 and sys.argv[4] == "direct"
if DIRECT:
    os.environ.update({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_PORT_QUARANTINE_S": "0",
                       "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "31700",
                       "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "31720",
                       "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"})

import ray  # noqa: E402
from ray import serve  # noqa: E402

from specray.bench import http_client  # noqa: E402
from specray.bench.http_compare import select_prompts  # noqa: E402
from specray.bench.http_local import run_in_process  # noqa: E402
from specray.bench.server_cpu import stat_seconds  # noqa: E402
from specray.bench.run import default_prompts_path  # noqa: E402
from specray.deployments.app import build_app_from_config  # noqa: E402
from specray.deployments.config import ServeConfig  # noqa: E402
from specray.deployments.local_engine import LocalEngine  # noqa: E402
from specray.engine.config import ChainConfig, EngineConfig, parse_chain  # noqa: E402

OUT = sys.argv[1]
SUMMARY_ONLY = OUT == "--summary"
STREAMS = [1, 4]
MAX_TOKENS = 128


def tree(root: int) -> dict[int, str]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        try:
            name = open(f"/proc/{p}/cmdline").read().split("\0")[0]
        except OSError:
            continue
        out[p] = name
        todo.extend(kids.get(p, []))
    return out


def cpu(pids: dict[int, str]) -> dict[int, float]:
    res = {}
    for p in pids:
        try:
            res[p] = stat_seconds(f"/proc/{p}/stat")
        except OSError:
            pass
    return res


def main() -> None:
    rounds, chain = int(sys.argv[2]), sys.argv[3]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 31690})
    base = "http://127.0.0.1:31690"
    engine = EngineConfig(chain=ChainConfig(speculators=parse_chain(chain)))
    targets = {}
    for layout in ("fused", "split"):
        cfg = ServeConfig(engine=engine, layout=layout, app_name=f"m-{layout}", route_prefix=f"/m-{layout}")
        serve.run(build_app_from_config(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix)
        targets[f"{layout}+proxy"] = f"{base}/m-{layout}"
    if DIRECT:
        ctrl = serve.context._global_client._controller
        for layout in ("fused", "split"):
            tgs = ray.get(ctrl.get_target_groups.remote(f"m-{layout}"))
            port = [t for g in tgs for t in g.targets if str(g.protocol).endswith("HTTP")][0].port
            targets[f"{layout}+direct"] = f"http://127.0.0.1:{port}/m-{layout}"
    print(targets, flush=True)
    threads = http_client.get_json(targets["fused+proxy"], "/v1/stats")["target"]["threads"]
    local = LocalEngine(engine.model_copy(update={"threads": threads}))
    prompts = select_prompts(default_prompts_path(), None, None, 8)
    names = ["in-process"] + list(targets)
    for n in names:  # warm-up
        if n == "in-process":
            run_in_process(local, prompts[:1], 1, 8)
        else:
            http_client.run(targets[n], prompts[:1], 1, 8)
    rows = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for c in STREAMS:
            for n in order:
                pids = tree(os.getpid())
                c0, t0 = cpu(pids), time.perf_counter()
                if n == "in-process":
                    res = run_in_process(local, prompts, c, MAX_TOKENS)
                else:
                    res = http_client.run(targets[n], prompts, c, MAX_TOKENS)
                c1 = cpu(pids)
                tokens = res["completion_tokens"] if "completion_tokens" in res else None
                per = {}
                for p, name in pids.items():
                    if p in c0 and p in c1 and c1[p] - c0[p] > 0:
                        key = "this process (client / in-process)" if p == os.getpid() else name
                        per[key] = per.get(key, 0) + c1[p] - c0[p]
                row = {"round": r, "target": n, "streams": c, "tok_s": res["tokens_per_s"],
                       "tokens": tokens, "wall": time.perf_counter() - t0, "cpu_s": per,
                       "errors": res["n_errors"], "load": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("round", "target", "streams", "tok_s", "tokens", "errors",
                                                      "load")}), flush=True)
                with open(OUT, "w") as f:
                    json.dump(rows, f, indent=1)
    local.close()
    serve.shutdown()
    ray.shutdown()
    summary(OUT)


def path_cpu(r: dict) -> dict[str, float]:
    """CPU ms per token of one run's request path, by process (only the target's own app's replicas)."""
    t = r["target"]
    app = t.split("+")[0]
    parts: dict[str, float] = {}
    for name, s in r["cpu_s"].items():
        n = name.replace("ray::", "")
        if t == "in-process":
            key = "engine" if name.startswith("this process") else None
        elif n.startswith(f"ServeReplica:m-{app}:"):
            key = n.split(":")[2]
        else:
            key = "proxy" if n.startswith("ProxyActor") and t.endswith("+proxy") else None
        if key:
            parts[key] = parts.get(key, 0.0) + 1000 * s / r["tokens"]
    return parts


def summary(path: str) -> None:
    """Per stream count and target: tok/s (all rounds, median), the request path's CPU ms/token and its excess
    over the in-process engine's in the same round (medians)."""
    import statistics as st

    rows = json.load(open(path))
    base = {(r["round"], r["streams"]): sum(path_cpu(r).values()) for r in rows if r["target"] == "in-process"}
    agg: dict[tuple, dict[str, list]] = {}
    for r in rows:
        p = path_cpu(r)
        d = agg.setdefault((r["streams"], r["target"]), {})
        d.setdefault("tok_s", []).append(r["tok_s"])
        d.setdefault("path", []).append(sum(p.values()))
        d.setdefault("extra", []).append(sum(p.values()) - base[(r["round"], r["streams"])])
        for n, v in p.items():
            d.setdefault(n, []).append(v)
    for (c, t), d in sorted(agg.items()):
        print(f"streams {c} {t:13s} tok/s {sorted(d['tok_s'])} median {st.median(d['tok_s']):6.1f} | path CPU "
              f"ms/token {st.median(d['path']):5.2f}, extra {st.median(d['extra']):5.2f} | "
              + ", ".join(f"{n} {st.median(v):.2f}" for n, v in d.items() if n not in ("tok_s", "path", "extra")))


if __name__ == "__main__":
    if SUMMARY_ONLY:
        summary(sys.argv[2])
    else:
        main()
