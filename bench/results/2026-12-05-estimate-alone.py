"""The draft policy's acceptance estimate (ValueEstimates.estimate: the tracker's prefix probabilities, then their
calibration) with its compiled core and with its Python reference, estimate_reference (benchmarks page, "More
compiled cores: ngram_mod, the estimates, suffix's pick"), in one process.

The estimates are trained as a chain's are: 2,000 judged drafts of 1-16 tokens over 4 sequences and 12 context
buckets, half of them sent and calibrated. Then each draft length is estimated 20,000 times (sequences and contexts
in turn) with the core and with the reference, alternately in blocks of 2,000, and every pair of arrays must be
bitwise equal. Times are means per estimate, the median of 5 repetitions (warm: a tight loop).

    .venv/bin/python bench/results/2026-12-05-estimate-alone.py OUT.json
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specray.engine.policy import estimates
from specray.engine.policy.estimates import ValueEstimates

LENGTHS = (1, 2, 4, 8, 16, 32)
N, BLOCK, REPS = 20_000, 2_000, 5


def trained() -> ValueEstimates:
    rng = np.random.default_rng(0)
    e = ValueEstimates()
    for _ in range(2000):
        k = int(rng.integers(1, 17))
        d = rng.integers(0, 3, k).astype(np.int32)
        emitted = np.concatenate([d[: int(rng.integers(0, k + 1))], [9]]).astype(np.int32)
        e.judged("s", int(rng.integers(0, 4)), d, emitted, int(rng.integers(0, 12)))
        if rng.random() < 0.5:
            e.calibrate("s", np.cumprod(rng.uniform(0.4, 1.0, k)), int(rng.integers(0, k + 1)))
    return e


def main() -> None:
    assert estimates.COMPILED_CORE, "the estimates' core is not built: pip install -e ."
    e = trained()
    modes = ("compiled", "reference")
    us = {k: {m: [] for m in modes} for k in LENGTHS}
    same = True
    for rep in range(REPS):
        for k in LENGTHS:
            total = {m: 0.0 for m in modes}
            for b in range(0, N, BLOCK):
                order = modes if (rep + b // BLOCK) % 2 == 0 else modes[::-1]
                for m in order:
                    f = e.estimate if m == "compiled" else e.estimate_reference
                    t0 = time.perf_counter()
                    for i in range(b, b + BLOCK):
                        f("s", i % 4, k, i % 12)
                    total[m] += time.perf_counter() - t0
            for m in modes:
                us[k][m].append(total[m] / N * 1e6)
            for i in range(48):
                a, r = e.estimate("s", i % 4, k, i % 12), e.estimate_reference("s", i % 4, k, i % 12)
                same = same and all(np.array_equal(x, y) for x, y in zip(a, r))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"command": " ".join(["bench/results/2026-12-05-estimate-alone.py", *sys.argv[1:]]), "commit": commit,
           "machine": platform.processor() or platform.machine(), "estimates": N, "reps": REPS,
           "bitwise_equal": same, "median_us": {k: {m: statistics.median(v) for m, v in d.items()}
                                                for k, d in us.items()},
           "repetitions_us": us}
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
    for k in LENGTHS:
        med = res["median_us"][k]
        print(f"length {k:2d}: compiled {med['compiled']:.2f} us, reference {med['reference']:.2f} us an estimate")
    print("bitwise equal:", same)


if __name__ == "__main__":
    main()
