"""Saving a sequence's cells to host memory (the prompt cache's host tier, `Context.save_seq`), by how the buffer
is had: a zero-filled ctypes array (before); native/host_memory.host_buffer alone (that array below 32 MiB, an
anonymous mapping with MAP_POPULATE from there on); the Context's default now (a buffer of a dropped save where
one fits, else host_buffer); and an anonymous mapping that asks for transparent huge pages (MADV_HUGEPAGE),
which host_buffer does not do.

Each way runs as a host tier at its budget would: every save is kept, and once KEEP entries are held the
oldest is dropped before the next save (for the default way, given back with Context.recycle). The tier drops
it in the round of the save that put it over its budget; a given-back buffer then waits for the next save.
One SmolLM2 context (flash attention, f16 K and V), sequences of 200, 600 and 1,700 tokens. The ways run in
blocks of SAVES saves (the first KEEP of a block, before any drop, are not counted), in turn, REPS rounds of
blocks, so drift hits all alike and no way's memory is another's (glibc hands freed memory to the next
allocation of that size: the zeroed array's steady state depends on it). Then a restore (Context.load_seq) of
each way's last save. Medians, milliseconds. Last, a tier still filling up: 8 saves of the 1,700-token sequence
per way, all kept (so the kernel supplies new memory for each), the ways interleaved save by save; every
save's time.

Run: .venv/bin/python bench/results/2026-12-04-host-save.py OUT.json [REPS]
"""
import ctypes
import json
import mmap
import statistics
import sys
import time

import numpy as np

from specray.native.context import Context
from specray.native.host_memory import host_buffer
from specray.native.model import Model

KEEP, SAVES = 4, 12
out_path = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
model = Model("smollm2-135m")
ctx = Context(model, n_ctx=4096, n_seq_max=4, flash_attn=True)


def huge(n: int) -> ctypes.Array:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return (ctypes.c_uint8 * n).from_buffer(m)


# (allocate for save_seq, give a dropped save back)
ways = {"zeroed ctypes array (before)": (lambda n: (ctypes.c_uint8 * n)(), None),
        "host_buffer alone": (host_buffer, None),
        "reused buffers, else host_buffer (now)": (None, ctx.recycle),
        "huge pages asked": (huge, None)}
rows = []
for n_tokens in (200, 600, 1700):
    ctx.clear_all()
    toks = np.random.default_rng(n_tokens).integers(100, 20000, n_tokens).astype(np.int32)
    for p0 in range(0, n_tokens, 256):
        ctx.batch.clear()
        ctx.batch.add_seq(0, toks[p0:p0 + 256], p0, 1)
        ctx.decode()
    save = {w: [] for w in ways}
    load = {w: [] for w in ways}
    for _ in range(reps):
        for w, (alloc, give) in ways.items():
            tier = []
            for i in range(SAVES):
                if len(tier) == KEEP:  # at its budget: the oldest entry goes before the next save
                    old = tier.pop(0)
                    if give is not None:
                        give(old)
                    del old
                t0 = time.perf_counter()
                saved = ctx.save_seq(0, allocate=alloc)
                dt = time.perf_counter() - t0
                if i >= KEEP:
                    save[w].append(dt)
                tier.append(saved)
            t0 = time.perf_counter()
            assert ctx.load_seq(1, tier[-1])
            load[w].append(time.perf_counter() - t0)
            ctx.clear_seq(1)
            for old in tier if give is not None else ():
                give(old)
            del tier, saved
    row = {"tokens": n_tokens, "bytes": ctx.save_seq(0, allocate=host_buffer).n_bytes,
           "save_ms": {w: round(1e3 * statistics.median(v), 2) for w, v in save.items()},
           "save_p90_ms": {w: round(1e3 * sorted(v)[int(0.9 * (len(v) - 1))], 2) for w, v in save.items()},
           "restore_ms": {w: round(1e3 * statistics.median(v), 2) for w, v in load.items()},
           "save_ms_all": {w: [round(1e3 * x, 2) for x in v] for w, v in save.items()}}
    rows.append(row)
    print(json.dumps({k: row[k] for k in ("tokens", "bytes", "save_ms", "save_p90_ms", "restore_ms")}), flush=True)
# a tier still filling up: every save kept, none dropped (no buffer to reuse, the kernel supplies new memory
# each time); the 1,700-token sequence, the ways interleaved save by save
fresh = {w: [] for w in ways if w != "reused buffers, else host_buffer (now)"}
kept = []
for _ in range(8):
    for w in fresh:
        t0 = time.perf_counter()
        kept.append(ctx.save_seq(0, allocate=ways[w][0]))
        fresh[w].append(round(1e3 * (time.perf_counter() - t0), 2))
del kept
print(json.dumps({"filling, 1,700 tokens, ms each save": fresh}), flush=True)
meta = {"reps": reps, "keep": KEEP, "saves_per_block": SAVES, "reused_saves": ctx.saved_buffers.reused,
        "thp_enabled": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "thp_defrag": open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}
json.dump({"meta": meta, "rows": rows, "filling_1700_tokens_ms": fresh}, open(out_path, "w"), indent=1)
