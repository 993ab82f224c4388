"""What moving hidden rows costs per round, distributed: bytes, object-store put/get time vs round time.

    python -m specray.bench.hidden --seqs 1 8 --transports object_store inline
    python -m specray.bench.hidden --target /models/SmolLM2.gguf --gpus 0.5 --transports object_store inline cuda_ipc

Starts local Ray, a target actor and a companion actor (as RouterCore does, with
the round scheduler in this process) and runs the same requests through
`mtp` (a synthetic glm4moe target whose NextN head copies its block, so
drafts are accepted and every round commits several rows per sequence) and
`eagle3` (SmolLM2-135M with a synthetic EAGLE-3 draft: three 576-wide layer
rows per token), or `dflash` (`--kinds dflash`: SmolLM2-135M with a synthetic
DFlash draft, three 576-wide layer rows per token, one block per draft). Per
configuration it prints rounds, hidden-row bytes per round, the target's
export time (ray.put) and the companion's open time (ray.get) per round, and
their share of the round time (the router's wall time per round). The
`inline` transport (rows by value through the router) is the baseline.
`--target` names the model the drafts are for and whose vocabulary the
synthetic MTP target borrows (a path where the packaged alias is not
installed); `--gpus 0.5` gives the target actor and the companion actor half
a Ray GPU each, so both share one GPU (their models offloaded to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid


def _run(kind: str, transport: str, n_seqs: int, max_tokens: int, paths: dict, inline_below: int = 0,
         gpus: float = 0.0) -> dict:
    import ray

    from specray.deployments.actors.launch import start_actors
    from specray.deployments.builder import build_engine
    from specray.deployments.config import ServeConfig
    from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig
    from specray.engine.request import GenerationRequest
    from specray.engine.sampling import SamplingParams

    hidden = {"mtp": True} if kind == "mtp" else {f"{kind}_model": paths[kind]}
    cfg = EngineConfig(model=paths["mtp"] if kind == "mtp" else paths["target"], slots=n_seqs, n_ctx=1024 * n_seqs,
                       calibrate=False, threads=1,
                       chain=ChainConfig(speculators=[kind], policy="first", n_max=4, params={kind: {"n_max": 4}}),
                       hidden=HiddenStateConfig(transport=transport, inline_below_bytes=inline_below, **hidden))
    # the replica's own actors and engine, with the round scheduler in this process
    serve_cfg = ServeConfig(mode="distributed", engine=cfg, target_cpus=0.5, companion_cpus=0.5,
                            target_gpus=gpus, companion_gpus=gpus,
                            actor_restart_attempts=1, actor_start_timeout_s=600, companion_call_timeout_s=600)
    actors = start_actors(serve_cfg, tag=f"hb-{uuid.uuid4().hex[:6]}")
    parts = build_engine(cfg, actors=actors)
    target, sup, chain, sched, vocab = (actors.target.handle, actors.companion.sup, parts.chain, parts.scheduler,
                                        parts.model)
    prompts = ["Write a haiku about caches.", "Name three primary colors.", "Explain what a hash table is.",
               "Tell me a story about a dog.", "What is TCP?", "List four prime numbers.",
               "Describe the water cycle.", "Why is the sky blue?"]
    reqs = [GenerationRequest(prompt_tokens=vocab.chat_tokens([{"role": "user", "content": prompts[i % 8]}]),
                              max_tokens=max_tokens, sampling=SamplingParams(), chain=(kind,), ignore_eos=True)
            for i in range(n_seqs)]
    # warm-up round trip (first ray.put / get, graph builds), not measured
    sched.run([GenerationRequest(prompt_tokens=reqs[0].prompt_tokens, max_tokens=4, sampling=SamplingParams(),
                                 chain=(kind,), ignore_eos=True)])
    chain.speculator(kind).flush()
    t_before = ray.get(target.counters.remote())["hidden_transport"]
    c_before = ray.get(sup.handle.counters.remote())
    rounds0 = sched.stats.rounds
    t0 = time.perf_counter()
    seqs = sched.run(reqs)
    wall = time.perf_counter() - t0
    chain.speculator(kind).flush()
    t_after = ray.get(target.counters.remote())["hidden_transport"]
    c_after = ray.get(sup.handle.counters.remote())
    rounds = sched.stats.rounds - rounds0
    records = t_after["exported"] - t_before["exported"]
    nbytes = t_after["exported_bytes"] - t_before["exported_bytes"]
    put = t_after["export_seconds"] - t_before["export_seconds"]
    get = c_after["hidden_transport_open_seconds"] - c_before["hidden_transport_open_seconds"]
    tokens = sum(len(s.generated) for s in seqs)
    acc = sum(s.spec_by_name[kind].accepted for s in seqs if kind in s.spec_by_name)
    drafted = sum(s.spec_by_name[kind].drafted for s in seqs if kind in s.spec_by_name)
    actors.close()
    per_round = wall / max(1, rounds)
    return {"kind": kind, "transport": transport, "seqs": n_seqs, "rounds": rounds, "records": records,
            "tokens": tokens, "tokens_per_s": tokens / wall, "round_ms": 1000 * per_round,
            "bytes_per_round": nbytes / max(1, rounds), "rows_per_round": nbytes / max(1, rounds) / 4 /
            (64 if kind == "mtp" else 3 * 576),
            "put_ms_per_round": 1000 * put / max(1, rounds), "get_ms_per_round": 1000 * get / max(1, rounds),
            "transfer_share": (put + get) / wall, "acceptance": acc / drafted if drafted else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specray.bench.hidden", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["mtp", "eagle3"], choices=["mtp", "eagle3", "dflash"])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8], help="concurrent sequences (slots) per run")
    p.add_argument("--transports", nargs="+", default=["object_store", "inline"],
                   choices=["object_store", "inline", "cuda_ipc"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--inline-below", type=int, nargs="+", default=[0], metavar="BYTES",
                   help="object_store runs: also with rows under BYTES sent by value (0: never; default: 0)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this path")
    p.add_argument("--target", default="smollm2-135m", metavar="MODEL",
                   help="the drafts' target (alias or GGUF path) and the synthetic MTP target's vocabulary "
                        "(default: %(default)s)")
    p.add_argument("--gpus", type=float, default=0.0, metavar="F",
                   help="Ray GPUs of the target actor and of the companion actor each (0.5: both on one GPU; "
                        "default: 0, CPU)")
    args = p.parse_args(argv)
    if not 0.0 <= args.gpus <= 1.0:
        p.error(f"--gpus must be in [0, 1], got {args.gpus}")
    import ray

    from specray.native.synthetic_gguf import MtpTargetSpec, write_dflash_draft, write_eagle3_draft, write_mtp_target

    tmp = tempfile.mkdtemp(prefix="specray-hidden-bench-")
    paths = {"target": args.target,
             "mtp": write_mtp_target(os.path.join(tmp, "mtp.gguf"), MtpTargetSpec(mtp_head="copy_last"), args.target),
             "eagle3": write_eagle3_draft(os.path.join(tmp, "eagle3.gguf"), target=args.target),
             "dflash": write_dflash_draft(os.path.join(tmp, "dflash.gguf"), target=args.target)}
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    rows = []
    print(f"{'kind':7} {'transport':12} {'seqs':>4} {'rounds':>6} {'round ms':>9} {'KiB/round':>9} "
          f"{'put ms':>7} {'get ms':>7} {'share':>6} {'tok/s':>7} {'accept':>6}")
    try:
        for kind in args.kinds:
            for n in args.seqs:
                runs = [(tr, ib) for tr in args.transports for ib in (args.inline_below if tr != "inline" else [0])]
                for tr, ib in runs:
                    r = _run(kind, tr, n, args.max_tokens, paths, ib, args.gpus)
                    r |= {"inline_below": ib, "gpus": args.gpus}
                    rows.append(r)
                    label = tr if not ib else f"{tr}<{ib // 1024}K"
                    print(f"{kind:7} {label:12} {n:>4} {r['rounds']:>6} {r['round_ms']:>9.2f} "
                          f"{r['bytes_per_round'] / 1024:>9.1f} {r['put_ms_per_round']:>7.3f} "
                          f"{r['get_ms_per_round']:>7.3f} {100 * r['transfer_share']:>5.1f}% "
                          f"{r['tokens_per_s']:>7.1f} {r['acceptance']:>6.2f}", flush=True)
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
