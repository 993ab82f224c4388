"""One KV cache all slots share (kv_unified, specray's fast mode) against one stream per slot (llama-server -np N):
4 sequences (prompts of 60, 70, 210 and 55 random tokens) decoded together, each step's batch carrying ROWS tokens
per sequence, both contexts on one model, interleaved, flash attention on; median ms of a step.

    .venv/bin/python scripts/measure_kv_layout.py [--model smollm2-135m] [--steps 64] [--passes 2] [--threads 2]

Measured on the 2-core EPYC box, SmolLM2, idle (docs/benchmarking.md): rows 1,1,1,1 (plain
decoding) 16.0-16.9 ms unified against 15.3-15.7 ms in streams; rows 1,4,1,3 (verifies of unequal length)
31.6-31.8 against 42.9-45.6 ms, since llama.cpp splits a batch over streams into ubatches with equally many tokens
of every sequence; rows 4,4,4,4 54.1-58.2 against 50.5-56.6 ms.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = ((1, 1, 1, 1), (1, 4, 1, 3), (4, 4, 4, 4))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged alias or .gguf path (default smollm2-135m)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per shape and layout (default 64)")
    p.add_argument("--passes", type=int, default=2, help="passes over every shape and layout (default 2)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    args = p.parse_args()
    if args.steps < 4 or args.passes < 1:
        p.error("--steps must be >= 4 and --passes >= 1")

    from specray.native.context import Context
    from specray.native.model import Model
    from specray.native.models import resolve_model

    model = Model(resolve_model(args.model))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(20000, model.n_vocab), n).astype(np.int32) for n in (60, 70, 210, 55)]
    n_ctx = 4096 if max(len(q) for q in prompts) + args.steps * 4 < 1024 else 8192  # a slot's share must fit
    ctxs = {u: Context(model, n_ctx=n_ctx, n_seq_max=4, n_threads=args.threads, flash_attn=True, kv_unified=u)
            for u in (True, False)}

    def step_ms(ctx, rows) -> float:
        ctx.clear_all()
        b = ctx.batch
        b.clear()
        for s, q in enumerate(prompts):
            b.add_seq(s, q, 0, 1)
        ctx.decode(b)
        pos = [len(q) for q in prompts]
        times = []
        for _ in range(args.steps):
            b.clear()
            for s in range(4):
                b.add_seq(s, rng.integers(100, 20000, rows[s]).astype(np.int32), pos[s], rows[s])
                pos[s] += rows[s]
            t0 = time.perf_counter()
            ctx.decode(b)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    for ctx in ctxs.values():  # warm-up: the first decodes of a context are slow
        step_ms(ctx, SHAPES[0])
    print(f"{'pass':>4} {'rows per sequence':>18} {'unified ms':>11} {'per slot ms':>12}")
    for i in range(args.passes):
        for rows in SHAPES:
            u, s = step_ms(ctxs[True], rows), step_ms(ctxs[False], rows)
            print(f"{i:>4} {','.join(map(str, rows)):>18} {u:>11.2f} {s:>12.2f}", flush=True)
    for ctx in ctxs.values():
        ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
