"""The target's decode cost, measured on its own context at start: what the cost model starts from.

Every function takes the target context (duck-typed: specray.native.Context) and uses one slot, which must be
idle, clearing it afterwards. After each timed decode the slot is brought back to the prefix: trimmed, or, for
a recurrent state that cannot be cut (engine/rollback.py), cleared and prefilled again, untimed.
"""

from __future__ import annotations

import time

import numpy as np

from .cost import CALIBRATION_PREFIX, paired_decode_costs

DECODE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def pooled_attention_slope(times: dict[tuple[int, int], float], short: int, long: int,
                           sizes: tuple[int, ...]) -> float:
    """Seconds per (token x KV cell) from decode times `times[prefix, n]` after a short and a long
    prefix: the extra time summed over sizes, over the extra token-cells summed (never negative).

    >>> t = {(64, 4): 0.030, (64, 16): 0.100, (768, 4): 0.035, (768, 16): 0.121}
    >>> round(pooled_attention_slope(t, 64, 768, (4, 16)) * 1e6, 2)   # us per token-cell
    1.85
    """
    dt = sum(times[long, n] - times[short, n] for n in sizes)
    cells = sum(n * (long - short) for n in sizes)
    return max(0.0, dt / cells) if cells > 0 else 0.0


def calibrate_cost(ctx, tile: int = 0) -> dict:
    """{"table": seconds by batch size, "attn_seconds": per token x KV cell, "read_seconds": per KV cell of a
    one-row decode, "tile_attn_seconds" and "subtile_attn_seconds": per token x KV cell in a decode of `tile`
    rows, the attention kernel's tile where rounds may be padded to it, and of half as many (0 without)}."""
    # read_seconds: the same slope for one row, which pays each cell's read alone (prompt cache: what an
    # idle slot's cells cost every decode in one KV pool without flash attention)
    out = {"table": measure_decode_costs(ctx), "attn_seconds": measure_attention_cost(ctx),
           "read_seconds": measure_attention_cost(ctx, sizes=(1,))}
    tile_costs = measure_tile_attention_costs(ctx, tile) if tile else (0.0, 0.0)
    out["subtile_attn_seconds"], out["tile_attn_seconds"] = tile_costs
    return out


def measure_tile_attention_costs(ctx, tile: int, short: int = CALIBRATION_PREFIX, long: int = 768,
                                 reps: int = 2) -> tuple[float, float]:
    """Seconds per (token x KV cell) of a decode of tile // 2 rows and of `tile` rows, the attention kernel's
    tile (native Context.attention_tile_rows): what each cell of a longer context adds to every row, below the
    tile and on it. Both at the same long context, as the rounds tile pads are for: the few-row slope of
    measure_attention_cost comes from a short one and few rows, and says less about a few dozen rows after
    hundreds of cached tokens.

    With two sequence ids, sequence 0 holds the long prefix and 1 the short one, and their decodes alternate:
    each slope is the median of `reps` paired differences, so a slow spell of the machine shifts a pair's two
    halves alike. With one sequence id, measure_attention_cost's phases. Both slots must be idle; they are
    cleared afterwards.
    """
    long = min(long, ctx.n_ctx_seq - tile - 1)
    if long <= short or tile > ctx.n_batch:
        return 0.0, 0.0
    sizes = (tile // 2, tile)
    if ctx.n_seq_max < 2:
        return tuple(measure_attention_cost(ctx, short=short, long=long, sizes=(n,), reps=1) for n in sizes)
    ids = _ids(long + tile)
    for seq_id, prefix in ((0, long), (1, short)):
        ctx.clear_seq(seq_id)
        _prefill(ctx, seq_id, ids, 0, prefix)
    diffs: dict[int, list[float]] = {n: [] for n in sizes}
    for n in sizes:
        decode_times(ctx, 1, ids, short, n, 0)  # warms up the buffers for the shape
    for _ in range(reps):
        for n in sizes:
            diffs[n].append(decode_times(ctx, 0, ids, long, n, 1, warm=False)[0]
                            - decode_times(ctx, 1, ids, short, n, 1, warm=False)[0])
    ctx.clear_seq(0)
    ctx.clear_seq(1)
    return tuple(max(0.0, float(np.median(diffs[n]))) / (n * (long - short)) for n in sizes)


def _ids(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) * 7 + 100) % 1000 + 10


def _prefill(ctx, seq_id: int, ids: np.ndarray, start: int, end: int) -> None:
    batch = ctx.batch
    for c0 in range(start, end, ctx.n_batch):
        batch.clear()
        batch.add_seq(seq_id, ids[c0 : min(end, c0 + ctx.n_batch)], c0, 1)
        ctx.decode(batch)


def _cut(ctx, seq_id: int, ids: np.ndarray, keep: int) -> None:
    """Bring seq_id's memory back to ids[:keep]: trimmed, or cleared and prefilled again where it cannot be."""
    if not ctx.seq_rm(seq_id, keep, -1):
        ctx.clear_seq(seq_id)
        _prefill(ctx, seq_id, ids, 0, keep)


def decode_times(ctx, seq_id: int, ids: np.ndarray, prefix: int, n: int, reps: int, warm: bool = True) -> list[float]:
    """Seconds of `reps` decodes of ids[prefix:prefix+n] after seq_id's first `prefix` cells, each
    removed again; with `warm`, a first, untimed decode warms up the buffers for this size."""
    batch = ctx.batch
    times = []
    for _ in range(reps + int(warm)):
        batch.clear()
        batch.add_seq(seq_id, ids[prefix : prefix + n], prefix, n)
        t0 = time.perf_counter()
        ctx.decode(batch)
        times.append(time.perf_counter() - t0)
        _cut(ctx, seq_id, ids, prefix)
    return times[int(warm):]


def measure_decode_costs(ctx, sizes: tuple[int, ...] = DECODE_SIZES, reps: int = 5,
                         prefix: int = CALIBRATION_PREFIX, seq_id: int = 0) -> dict[int, float]:
    """Seconds per decode of n tokens after a short prefix.

    Timed in pairs with a 1-token decode (cost.paired_decode_costs): a slow spell of the host
    must not become the table's shape.
    """
    sizes = tuple(n for n in sizes if n <= ctx.n_batch)
    if not sizes:
        return {}
    ids = _ids(prefix + max(sizes))
    ctx.clear_seq(seq_id)
    _prefill(ctx, seq_id, ids, 0, prefix)
    for n in sizes:  # warm up the buffers for every size
        decode_times(ctx, seq_id, ids, prefix, n, 0)
    out = paired_decode_costs(sizes, reps, lambda n: decode_times(ctx, seq_id, ids, prefix, n, 1, warm=False)[0])
    ctx.clear_seq(seq_id)
    return out


def measure_attention_cost(ctx, short: int = CALIBRATION_PREFIX, long: int = 512,
                           sizes: tuple[int, ...] = (4, 8), reps: int = 5, seq_id: int = 0) -> float:
    """Seconds per (token x KV cell): what each cell of a longer context adds to every token of a
    decode, i.e. what a draft row pays beyond the table's price.

    Timed after the short prefix, then after extending it to the long one, then after cutting it
    back, each the fastest of `reps` decodes, and pooled over the batch sizes. Sizes of a few
    rows, as draft rows come: one row's decode also pays the cells' read, which more rows share,
    and large batches vary too much from run to run; a slope per size with a 1-token decode among
    them is not stable between start-ups.
    With a unified KV cache the whole cache must be idle: every cell in use is attended.
    """
    long = min(long, ctx.n_ctx_seq - max(sizes) - 1)
    sizes = tuple(n for n in sizes if n <= ctx.n_batch)
    if long <= short or not sizes:
        return 0.0
    ids = _ids(long + max(sizes))

    def timed(prefix: int) -> dict[int, float]:
        # the fastest: interference only ever slows a decode down
        return {n: min(decode_times(ctx, seq_id, ids, prefix, n, reps)) for n in sizes}

    ctx.clear_seq(seq_id)
    _prefill(ctx, seq_id, ids, 0, short)
    before = timed(short)
    _prefill(ctx, seq_id, ids, short, long)
    after_long = timed(long)
    _cut(ctx, seq_id, ids, short)
    again = timed(short)
    ctx.clear_seq(seq_id)
    t = {(long, n): after_long[n] for n in sizes}
    t |= {(short, n): min(before[n], again[n]) for n in sizes}
    return pooled_attention_slope(t, short, long, sizes)
