"""Host-tier look-up cost: the one-by-one scan (the code before the radix index) against HostTier.best.

Run: .venv/bin/python bench/results/2026-12-04-radix-lookup.py OUT.json
"""
import json, sys, time
import numpy as np
from specray.engine.host_tier import HostTier
from specray.engine.prompt_cache import common_prefix

def scan_best(entries, prompt):
    best, n = None, 0
    for k, t in entries.items():
        m = common_prefix(t, prompt)
        if m > n:
            best, n = k, m
    return best, n

rng = np.random.default_rng(0)
system = rng.integers(0, 49000, 1600).astype(np.int32)
rows = []
for n in (16, 64, 256, 1024):
    tier, entries = HostTier(1 << 40), {}
    for i in range(n):
        t = np.concatenate([system, rng.integers(0, 49000, 100 + i % 50)]).astype(np.int32)
        k = tier.new_key(); tier.add(k, t, 1000); entries[k] = t
    # a later turn of conversation n//2 and a new conversation
    probes = [np.concatenate([entries[n // 2], rng.integers(0, 49000, 60)]).astype(np.int32),
              np.concatenate([system, rng.integers(0, 49000, 60)]).astype(np.int32)]
    for name, p in zip(("later turn", "new conversation"), probes):
        assert scan_best(entries, p)[1] == tier.best(p)[1]
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps): scan_best(entries, p)
        t1 = time.perf_counter()
        for _ in range(reps): tier.best(p)
        t2 = time.perf_counter()
        rows.append({"entries": n, "probe": name, "scan_us": round(1e6 * (t1 - t0) / reps, 1),
                     "radix_us": round(1e6 * (t2 - t1) / reps, 1), "nodes": tier.index.nodes()})
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1) if len(sys.argv) > 1 else None
