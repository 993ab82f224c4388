"""Greedy top tokens picked by llama.cpp inside the decode (backend sampling) against the host's argmax over the
logits rows it copies out, interleaved on one context: can greedy verification work from a top-1 per row?

Each round decodes S sequences x K rows (one committed token and K-1 draft rows, all outputting, as a verify
does), reads each row's top token one way or the other, then removes the rows again. The two ways alternate,
so drift on a noisy machine hits both. Every round's tokens must agree; the script stops on the first mismatch.

    .venv/bin/python scripts/measure_backend_sampling.py --slots 1 4 8 --rows 1 4 --reps 40 [--n-gpu-layers N]

Measured on the 2-core EPYC box (SmolLM2, flash attention, 2 threads, --reps 30), a round (decode + top tokens)
with backend sampling over the host's argmax: 1.01x (1 sequence x 1 row), 1.10x (1x4), 1.08x (4x1), 1.04x
(4x4), 1.06x (8x1), 1.05x (8x4: 109.2 -> 114.3 ms). The host's argmax it saves is 0.05-0.45 ms; the decode
grows by more (llama.cpp pads a copy of the logits and runs one argmax node per row, each on one thread).
So on CPU the host keeps the argmax. On a GPU the logits rows also cross PCIe and the argmax is one small
kernel: that is the measurement this script waits for (scripts/gpu-measure.sh sampling).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from specray.native.context import Context
from specray.native.model import Model

TOKENS = np.array([198, 504, 3000, 42, 7, 11, 19, 1030], dtype=np.int32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model path or alias (default: %(default)s)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4, 8], help="sequences per decode")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help=f"output rows per sequence (<= {len(TOKENS)})")
    ap.add_argument("--reps", type=int, default=40, help="rounds of each way per shape (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gpu-layers", type=int, default=None, help="default: all where a GPU is visible")
    ap.add_argument("--json", help="write the table as JSON here")
    a = ap.parse_args(argv)
    if max(a.rows) > len(TOKENS) or min(a.rows) < 1:
        ap.error(f"--rows: each between 1 and {len(TOKENS)}")
    model = Model(a.model, n_gpu_layers=a.n_gpu_layers)
    prompt = model.tokenize("Write a long story about a dragon who learns to cook pasta in Rome.")
    table = []
    for slots in a.slots:
        ctx = Context(model, n_ctx=4096, n_seq_max=slots, n_batch=512, flash_attn=True, n_threads=a.threads,
                      outputs_per_seq=len(TOKENS))
        b = ctx.batch
        for s in range(slots):  # every sequence holds the prompt
            b.clear()
            b.add_seq(s, prompt, 0, 1)
            ctx.decode(b)
        pos = len(prompt)
        for k in a.rows:
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(a.reps):
                tops = {}
                for backend in (False, True):
                    for s in range(slots):
                        ctx.set_greedy_backend(s, backend)
                    for timed in (False, True):  # the first decode after a sampler change builds its graph
                        b.clear()
                        for s in range(slots):
                            b.add_seq(s, TOKENS[:k], pos, k)
                        t0 = time.perf_counter()
                        logits = ctx.decode(b)
                        t1 = time.perf_counter()
                        top = (ctx.sampled_tokens(range(slots * k)) if backend
                               else np.argmax(logits, axis=1).astype(np.int32))
                        t2 = time.perf_counter()
                        for s in range(slots):
                            ctx.seq_rm(s, pos, -1)
                        if timed:
                            times[backend].append((t1 - t0, t2 - t1))
                    tops[backend] = top
                if not np.array_equal(tops[False], tops[True]):
                    print(f"MISMATCH at {slots}x{k}: host {tops[False].tolist()} backend {tops[True].tolist()}")
                    return 1
            row = {"slots": slots, "rows": k}
            for backend, name in ((False, "host"), (True, "backend")):
                t = np.array(times[backend]) * 1e3
                row[name] = {"decode_ms": float(np.median(t[:, 0])), "top_ms": float(np.median(t[:, 1])),
                             "round_ms": float(np.median(t.sum(axis=1)))}
            row["backend_over_host"] = row["backend"]["round_ms"] / row["host"]["round_ms"]
            table.append(row)
            print(f"{slots} x {k} rows: host argmax {row['host']['decode_ms']:.3f} + {row['host']['top_ms']:.3f} ms, "
                  f"backend {row['backend']['decode_ms']:.3f} + {row['backend']['top_ms']:.3f} ms "
                  f"({row['backend_over_host']:.3f}x a round; tokens equal in all {a.reps})", flush=True)
        for s in range(slots):
            ctx.set_greedy_backend(s, False)
        ctx.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "n_gpu_layers": model.n_gpu_layers, "table": table},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
