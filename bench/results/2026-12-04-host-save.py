"""Saving a sequence's cells to host memory (the prompt cache's host tier), three ways of getting the buffer:
a zero-filled ctypes array (before), native/host_memory.host_buffer (an anonymous mapping with MAP_POPULATE),
and an anonymous mapping that asks for transparent huge pages (MADV_HUGEPAGE), which host_buffer does not do
(this run shows why). One SmolLM2 context (flash
attention, f16 K and V), sequences of 200, 600 and 1,700 tokens; each save into a new buffer that is kept, as
the host tier keeps its entries (so every save meets pages never touched before), the ways interleaved; then
the restore (llama_state_seq_set_data) of each kind of buffer. Medians of REPS, milliseconds.

Run: .venv/bin/python bench/results/2026-12-04-host-save.py OUT.json [REPS]
"""
import ctypes
import json
import mmap
import statistics
import sys
import time

import llama_cpp
import numpy as np

from specray.native.context import Context
from specray.native.host_memory import host_buffer
from specray.native.model import Model

out_path = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
model = Model("smollm2-135m")
ctx = Context(model, n_ctx=4096, n_seq_max=4, flash_attn=True)


def huge(n: int) -> ctypes.Array:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return (ctypes.c_uint8 * n).from_buffer(m)


ways = {"zeroed ctypes array": lambda n: (ctypes.c_uint8 * n)(), "host_buffer (MAP_POPULATE)": host_buffer,
        "huge pages asked": huge}
rows = []
for n_tokens in (200, 600, 1700):
    ctx.clear_all()
    toks = np.random.default_rng(n_tokens).integers(100, 20000, n_tokens).astype(np.int32)
    for p0 in range(0, n_tokens, 256):
        ctx.batch.clear()
        ctx.batch.add_seq(0, toks[p0:p0 + 256], p0, 1)
        ctx.decode()
    size = int(llama_cpp.llama_state_seq_get_size(ctx.ptr, 0))
    save = {w: [] for w in ways}
    load = {w: [] for w in ways}
    kept = []
    for _ in range(reps):
        for w, alloc in ways.items():
            t0 = time.perf_counter()
            buf = alloc(size)
            assert int(llama_cpp.llama_state_seq_get_data(ctx.ptr, buf, size, 0)) == size
            save[w].append(time.perf_counter() - t0)
            kept.append(buf)
            t0 = time.perf_counter()
            assert ctx.load_seq(1, buf)
            load[w].append(time.perf_counter() - t0)
            ctx.clear_seq(1)
        if len(kept) > 24:  # bounded memory: the oldest go, as a host tier's budget would drop them
            del kept[:12]
    row = {"tokens": n_tokens, "bytes": size,
           "save_ms": {w: round(1e3 * statistics.median(v), 2) for w, v in save.items()},
           "restore_ms": {w: round(1e3 * statistics.median(v), 2) for w, v in load.items()},
           "save_ms_all": {w: [round(1e3 * x, 2) for x in v] for w, v in save.items()}}
    rows.append(row)
    print(json.dumps({k: row[k] for k in ("tokens", "bytes", "save_ms", "restore_ms")}), flush=True)
meta = {"reps": reps, "thp_enabled": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "thp_defrag": open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}
json.dump({"meta": meta, "rows": rows}, open(out_path, "w"), indent=1)
