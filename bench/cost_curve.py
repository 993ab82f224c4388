"""The target's verify cost curve: seconds of a k-token decode for k = 1..K, and cost(k)/cost(1).

A speculative round verifies 1 + draft tokens in one decode; whether drafts pay depends on how fast that
decode grows with k. The engine's own calibration (engine/target_calibration.py, which `specray bench`
prints as "verify cost ms by batch size") times a few sizes at start-up; this times every k up to K the same
way (paired with a 1-token decode, median of `reps`, after a short prefix), on a context of its own.
`specray cost-curve --model FILE` prints it; a model written by `specray synth-model` is labelled
synthetic in the table and the JSON.
"""

from __future__ import annotations

import platform
import time


def ratios(costs: dict[int, float]) -> dict[int, float]:
    """cost(k)/cost(1) for every k measured.

    >>> ratios({1: 0.002, 2: 0.0021, 4: 0.0026})
    {1: 1.0, 2: 1.05, 4: 1.3}
    """
    one = costs[1]
    return {k: round(v / one, 4) for k, v in costs.items()}


def measure_cost_curve(model_path: str, *, max_k: int = 16, reps: int = 5, threads: int = 4,
                       n_gpu_layers: int | None = None, flash_attn: bool = False) -> dict:
    """Load `model_path`, time decodes of k = 1..max_k tokens, return the curve with what it was measured on."""
    from specray.engine.target_calibration import measure_decode_costs
    from specray.native import lib
    from specray.native.context import Context
    from specray.native.model import Model
    from specray.native.synthetic_llama import is_synthetic

    t0 = time.perf_counter()
    model = Model(model_path, n_gpu_layers=n_gpu_layers)
    load_s = time.perf_counter() - t0
    ctx = Context(model, n_ctx=512, n_seq_max=1, n_batch=max(64, max_k), n_threads=threads, flash_attn=flash_attn)
    try:
        costs = measure_decode_costs(ctx, sizes=tuple(range(1, max_k + 1)), reps=reps)
    finally:
        ctx.close()
    return {
        "model": model.path, "synthetic": is_synthetic(model.path), "description": model.description,
        "n_params": model.n_params,
        "n_gpu_layers": model.n_gpu_layers, "gpu_offload": lib.gpu_offload(), "threads": threads,
        "flash_attn": flash_attn, "reps": reps, "load_s": round(load_s, 2), "python": platform.python_version(),
        "cost_ms": {k: round(v * 1000, 4) for k, v in costs.items()}, "ratio": ratios(costs),
    }


def format_curve(r: dict) -> str:
    """The table `specray cost-curve` prints.

    >>> print(format_curve({"model": "/m/x.gguf", "synthetic": True, "description": "llama ?B Q8_0",
    ...                     "n_params": 1499224576, "n_gpu_layers": 999, "threads": 4,
    ...                     "cost_ms": {1: 2.0, 2: 2.1}, "ratio": {1: 1.0, 2: 1.05}}))
    x.gguf (llama ?B Q8_0, 1.50B params) SYNTHETIC: random weights, step times only; GPU layers 999, 4 threads
     k  cost ms  cost(k)/cost(1)
     1    2.000             1.00
     2    2.100             1.05
    """
    label = " SYNTHETIC: random weights, step times only;" if r["synthetic"] else ""
    lines = [f"{r['model'].rsplit('/', 1)[-1]} ({r['description']}, {r['n_params'] / 1e9:.2f}B params){label} "
             f"GPU layers {r['n_gpu_layers']}, {r['threads']} threads", " k  cost ms  cost(k)/cost(1)"]
    lines += [f"{k:2d} {r['cost_ms'][k]:8.3f} {r['ratio'][k]:16.2f}" for k in sorted(r["cost_ms"])]
    return "\n".join(lines)
