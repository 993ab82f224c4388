"""The companion's round call, by actor call against through a Ray compiled graph (ServeConfig.companion_hop),
as the router makes it (CompanionClient.call) to a real companion actor with a real draft model. The rounds are
empty (no requests, nothing to mirror), so what is timed is the hop: the call's wall time minus the time the
companion reports inside it. The two hops alternate in passes, so drift on a noisy machine hits both.

    .venv/bin/python scripts/measure_companion_hop.py [--calls 300] [--passes 2] [--model smollm2-135m]

Measured on the 2-core EPYC box, idle, SmolLM2 as the draft model, 300 calls a pass, two passes: median
1.49 / 1.33 ms by actor call, 0.44 / 0.43 ms through the graph; a later run of 200 calls, 1.43 against 0.22 ms
(docs/serving.md).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="timed round calls per hop and pass (default 300)")
    p.add_argument("--passes", type=int, default=2, help="passes over both hops (default 2)")
    p.add_argument("--model", default="smollm2-135m", help="target vocabulary and draft model (default smollm2-135m)")
    args = p.parse_args()
    if args.calls < 10 or args.passes < 1:
        p.error("--calls must be >= 10 and --passes >= 1")

    import ray

    from specray.deployments.actors.companion import CompanionActor
    from specray.deployments.actors.companion_client import CompanionClient
    from specray.deployments.actors.supervisor import ActorSupervisor
    from specray.engine.config import EngineConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = EngineConfig(model=args.model, slots=4, n_ctx=2048, threads=1, calibrate=False,
                       draft={"model": args.model, "threads": 1})

    def make(gen: int):
        return CompanionActor.options(num_cpus=0.1).remote(cfg.model_dump()), f"companion-{gen}"

    def ready(handle, name: str) -> dict:
        return ray.get(handle.info.remote(), timeout=300) | {"actor_name": name}

    sup = ActorSupervisor("companion", make, ready, max_attempts=1)
    sup.start()
    client = CompanionClient(sup, timeout_s=30)
    payload = {"params": {}, "ends": [], "begins": [], "shifts": [], "commits": [], "requests": []}
    try:
        for _ in range(args.passes):
            for hop in ("actor", "compiled"):
                client.use_hop(hop)
                for _ in range(20):  # warm-up (the graph compiles on its first call)
                    client.call("round", payload)
                out = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    res = client.call("round", payload)
                    if res is None:
                        raise SystemExit(f"the companion failed a {hop} call: {sup.last_error}")
                    out.append(1000 * (time.perf_counter() - t0 - res["inside_s"]))
                out.sort()
                print(f"{hop:9s} outside the companion: median {statistics.median(out):.3f} ms, "
                      f"p10 {out[len(out) // 10]:.3f}, p90 {out[9 * len(out) // 10]:.3f} ({args.calls} calls)",
                      flush=True)
    finally:
        client.close_channel()
        sup.close()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
