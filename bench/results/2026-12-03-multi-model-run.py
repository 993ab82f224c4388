"""Measure: one two-model app vs two one-model apps (same Ray, same machine), startup time and memory."""
import json, os, subprocess, sys, time
import httpx, ray
from ray import serve
from specray.deployments.app import build_app

OUT = sys.argv[1]
ENGINE = {"slots": 4, "threads": 1, "n_ctx": 4096}
GEMMA = {"model": "gemma3-270m"}
COMMON = {"mode": "colocated", "layout": "split", "replica_cpus": 0.2, "ingress_cpus": 0.1}
apps = {
    "multi": COMMON | {"engine": ENGINE, "models": [{"id": "smol", "engine": {"model": "smollm2-135m"}},
                                                      {"id": "gemma", "engine": GEMMA}]},
    "smol": COMMON | {"engine": ENGINE | {"model": "smollm2-135m"}, "served_model_name": "smol"},
    "gemma": COMMON | {"engine": ENGINE | GEMMA, "served_model_name": "gemma"},
}
ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": 8011})
meta = {}
for name, args in apps.items():
    t0 = time.perf_counter()
    serve.run(build_app(args | {"app_name": name, "route_prefix": f"/{name}"}), name=name, route_prefix=f"/{name}")
    dt = time.perf_counter() - t0
    st = httpx.get(f"http://127.0.0.1:8011/{name}/v1/stats", timeout=60).json()
    blocks = st["models"] if "models" in st else {name: {"arms": st["arms"]}}
    pids = set(st["ingress"]["pids"])
    for b in blocks.values():
        pids |= set(b["arms"]["default"]["engine"]["pids"])
    rss = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            rss += next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
    meta[name] = {"deploy_s": round(dt, 1), "processes": len(pids), "rss_mib": round(rss / 2**20, 1)}
    print(name, meta[name], flush=True)
json.dump(meta, open(OUT + "-startup.json", "w"), indent=2)
cmd = [sys.executable, "-m", "specray.cli.main", "bench", "--url", "http://127.0.0.1:8011/multi",
       "--models", "smol", "gemma", "--models", "smol@http://127.0.0.1:8011/smol", "gemma@http://127.0.0.1:8011/gemma",
       "--concurrency", "4", "--num-prompts", "16", "--max-tokens", "96", "--repeats", "2", "--json", OUT + ".json"]
print(" ".join(cmd), flush=True)
subprocess.run(cmd, check=False)
serve.shutdown(); ray.shutdown()
