"""The tie bound's probes: how much a row's logits drift with the batch it is in, and with where a
sequence's KV cells lie among other sequences'. `specray bench` counts a divergence from `none` that begins
at a top-2 margin below twice the larger drift as a tie, not a mismatch.

Both probes decode a prefix first (by default four copies of the bench's first prompt: attention over a
context of a realistic length), then compare the logits of the same probe tokens decoded two ways. The
prefix is only context: both ways attend to the very same KV cells, so it is prefilled in chunks that fit
n_batch, and cut to a share of the context (and to PROBE_PREFIX_MAX), whatever the prompt's length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specray.deployments.local_engine import LocalEngine

#: the longest prefix a probe prefills: enough context for attention to sum over many cells, while a
#: long first prompt (or a large --n-ctx) does not make the start-up probes take long (the batch probe
#: prefills it once, the layout probe three times: alone, and interleaved with a second sequence)
PROBE_PREFIX_MAX = 2048


def probe_prefix(sample: np.ndarray, copies: int = 4, cap: int = PROBE_PREFIX_MAX) -> np.ndarray:
    """`copies` copies of `sample` back to back, at most `cap` tokens: the probes' prefix from the bench's
    first prompt (a short prompt gives a context a few turns long; a long one is cut).

    >>> probe_prefix(np.array([1, 2, 3])).tolist()
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    >>> p = probe_prefix(np.arange(1000, dtype=np.int32))
    >>> len(p), p[998:1002].tolist(), p.dtype.name
    (2048, [998, 999, 0, 1], 'int32')
    """
    return np.resize(sample, min(copies * len(sample), cap))


def prefill(ctx, seq_ids: tuple[int, ...], tokens: np.ndarray, step: int | None = None) -> None:
    """Decode `tokens` at positions 0... into every sequence of `seq_ids`, position by position (with two
    sequences their KV cells interleave), `step` positions a decode (default: as many as fit n_batch)."""
    step = max(1, min(step or ctx.n_batch, ctx.n_batch // len(seq_ids)))
    b = ctx.batch
    for c in range(0, len(tokens), step):
        end = min(len(tokens), c + step)
        b.clear()
        for i in range(c, end):
            for s in seq_ids:
                # a decode must output something: the chunk's last row (its logits are not read)
                b.add_seq(s, tokens[i : i + 1], i, 1 if i == end - 1 and s == seq_ids[0] else 0)
        ctx.decode(b)


def measure_batch_variance(engine: LocalEngine, prefix_tokens: np.ndarray, n: int | tuple[int, ...] = 8) -> float:
    """Largest |logit| difference between n tokens decoded in one batch and one by one, after the prefix
    (the largest over several batch sizes if n is a tuple: kernels switch with the row count). Sizes above
    n_batch are measured at n_batch; the prefix is cut to half of a sequence's cells."""
    sizes = sorted({min(k, engine.ctx.n_batch) for k in ((n,) if isinstance(n, int) else n)})
    ctx = engine.ctx
    slot = engine.config.slots - 1
    b = ctx.batch
    p = prefix_tokens[: min(len(prefix_tokens), ctx.n_ctx_seq // 2, PROBE_PREFIX_MAX)]
    ctx.clear_seq(slot)
    prefill(ctx, (slot,), p)  # once for every size: each size's rows are removed again
    worst = 0.0
    for k in sizes:
        nxt = _probe_tokens(engine, k)
        b.clear(); b.add_seq(slot, nxt, len(p), k); batched = ctx.decode(b).copy()  # noqa: E702
        _back_to(ctx, slot, p)
        ones = _decode_one_by_one(ctx, slot, nxt, len(p))
        _back_to(ctx, slot, p)
        worst = max(worst, float(np.abs(batched - ones).max()))
    ctx.clear_seq(slot)
    return worst


def _back_to(ctx, slot: int, p: np.ndarray) -> None:
    """The slot's memory back to the prefix p: its later cells dropped, or, for a recurrent state that cannot
    drop them (engine/rollback.py), cleared and p prefilled again."""
    if not ctx.seq_rm(slot, len(p), -1):
        ctx.clear_seq(slot)
        prefill(ctx, (slot,), p)


def _probe_tokens(engine: LocalEngine, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) * 97 + 500) % engine.model.n_vocab


def _decode_one_by_one(ctx, slot: int, tokens: np.ndarray, pos0: int) -> np.ndarray:
    """Logits of `tokens` decoded one per batch at positions pos0..., stacked."""
    b, out = ctx.batch, []
    for i in range(len(tokens)):
        b.clear(); b.add_seq(slot, tokens[i : i + 1], pos0 + i, 1)  # noqa: E702
        out.append(ctx.decode(b)[0].copy())
    return np.stack(out)


def measure_layout_variance(engine: LocalEngine, prefix_tokens: np.ndarray, n: int = 8) -> float:
    """Largest |logit| difference for the same tokens of one sequence when its KV cells lie alone and when
    they are interleaved with another sequence's (0 with one slot or one KV stream per slot). Kernels that
    sum attention over KV tiles (flash attention) skip or pad them by layout, so with several slots a
    sequence's logits depend on where its neighbours' cells lie, which measure_batch_variance never sees.
    The prefix is cut to a quarter of the cells (two sequences hold it)."""
    ctx = engine.ctx
    if engine.config.slots < 2 or not ctx.kv_unified:
        return 0.0
    s, t = engine.config.slots - 1, engine.config.slots - 2
    p = prefix_tokens[: min(len(prefix_tokens), ctx.n_ctx_seq // 4, PROBE_PREFIX_MAX)]
    nxt = _probe_tokens(engine, n)

    def probe(interleaved: bool) -> np.ndarray:
        ctx.clear_seq(s); ctx.clear_seq(t)  # noqa: E702
        # chunks of the same positions either way (what fits n_batch with two sequences)
        prefill(ctx, (s, t) if interleaved else (s,), p, step=ctx.n_batch // 2)
        out = _decode_one_by_one(ctx, s, nxt, len(p))
        ctx.clear_seq(s); ctx.clear_seq(t)  # noqa: E702
        return out

    return float(np.abs(probe(False) - probe(True)).max())
