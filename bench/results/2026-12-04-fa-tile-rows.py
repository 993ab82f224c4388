"""What a decode costs just below and at the CPU flash-attention kernel's tile (64 query rows), on SmolLM2 with
flash attention, 2 threads, one KV pool: medians of interleaved repeats, milliseconds.

1. One sequence holding 1,700 cached tokens decodes N rows after them (each decode's rows removed again).
2. Four sequences share a 1,600-token prefix (seq_cp) and hold 150 tokens each of their own; a round carries
   3 x 2 verify rows and N prompt rows of the fourth (a later turn), unpadded and padded to 64 rows with rows
   of the fourth sequence that ask for no output (as engine/tile_pads.py pads).

Run: .venv/bin/python bench/results/2026-12-04-fa-tile-rows.py OUT.json
"""
import json
import sys
import time

import numpy as np

from specray.native.context import Context
from specray.native.model import Model

model = Model("smollm2-135m")
toks = np.random.default_rng(0).integers(100, 40000, size=4000).astype(np.int32)
out = {"one_sequence_1700": {}, "four_sequences_shared_1600": {}}


def prefill(ctx, seq, tokens, pos0):
    b = ctx.batch
    for p in range(0, len(tokens), 512):
        b.clear()
        b.add_seq(seq, tokens[p : p + 512], pos0 + p, 1)
        ctx.decode(b)


ctx = Context(model, n_ctx=4096, n_seq_max=4, n_batch=512, flash_attn=True, n_threads=2, kv_unified=True)
prefill(ctx, 0, toks[:1700], 0)
rows_list = (8, 32, 50, 63, 64, 80, 128)
times = {n: [] for n in rows_list}
for _ in range(5):
    for n in rows_list:
        ctx.batch.clear()
        ctx.batch.add_seq(0, toks[1700 : 1700 + n], 1700, 1)
        t0 = time.perf_counter()
        ctx.decode(ctx.batch)
        times[n].append(time.perf_counter() - t0)
        ctx.seq_rm(0, 1700, -1)
for n in rows_list:
    out["one_sequence_1700"][n] = round(float(np.median(times[n])) * 1e3, 1)
    print(f"one sequence, 1,700 cached: {n} rows {out['one_sequence_1700'][n]} ms", flush=True)
ctx.close()

ctx = Context(model, n_ctx=4096, n_seq_max=8, n_batch=512, flash_attn=True, n_threads=2, kv_unified=True)
prefill(ctx, 0, toks[:1600], 0)
for s in (1, 2, 3):
    ctx.seq_cp(0, s, -1, -1)
for s in range(4):
    prefill(ctx, s, toks[2000 + 150 * s : 2000 + 150 * (s + 1)], 1600)
pos = 1750


def round_ms(n_prompt: int, pad: int) -> float:
    b = ctx.batch
    b.clear()
    for s in range(3):
        b.add_seq(s, toks[3000:3002], pos, 2)
    b.add_seq(3, toks[3100 : 3100 + n_prompt], pos, 1)
    if pad:
        b.add_seq(3, np.full(pad, toks[3100 + n_prompt - 1], np.int32), pos + n_prompt, 0)
    t0 = time.perf_counter()
    ctx.decode(b)
    dt = time.perf_counter() - t0
    for s in range(4):
        ctx.seq_rm(s, pos, -1)
    return dt


cases = [(n, p) for n in (20, 30, 40, 50) for p in (0, 64 - 6 - n)]
times2 = {c: [] for c in cases}
for _ in range(4):
    for c in cases:
        times2[c].append(round_ms(*c))
for n, p in cases:
    ms = round(float(np.median(times2[(n, p)])) * 1e3, 1)
    out["four_sequences_shared_1600"].setdefault(str(n), {})["padded" if p else "unpadded"] = ms
    print(f"four sequences: {n} prompt rows + 6 verify rows, {'padded to 64' if p else 'unpadded'}: {ms} ms",
          flush=True)
ctx.close()
json.dump(out, open(sys.argv[1], "w"), indent=1)
