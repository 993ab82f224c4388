"""Exact mode: a token's logits do not depend on what else shares its batch."""

from __future__ import annotations

import numpy as np
import pytest

from specray.native.context import Context

pytestmark = pytest.mark.model


def _batched_vs_one_by_one(model, exact: bool, prefix_len: int) -> float:
    ctx = Context(model, n_ctx=2048, n_seq_max=4, n_batch=512, exact=exact)
    base = model.tokenize("The quick brown fox jumps over the lazy dog. " * 80)[:prefix_len]
    nxt = np.array([100, 200, 300, 400, 500, 600, 700, 800], dtype=np.int32)
    b = ctx.batch
    b.clear(); b.add_seq(0, base, 0, 1); ctx.decode()  # noqa: E702
    b.clear(); b.add_seq(0, nxt, len(base), 8); batched = ctx.decode().copy()  # noqa: E702
    ctx.seq_rm(0, len(base), -1)
    ones = []
    for i in range(8):
        b.clear(); b.add_seq(0, nxt[i : i + 1], len(base) + i, 1)  # noqa: E702
        ones.append(ctx.decode()[0].copy())
    ctx.close()
    return float(np.abs(batched - np.stack(ones)).max())


@pytest.mark.parametrize("prefix_len", [20, 260, 420])
def test_smollm2_exact_mode_is_bitwise_batch_invariant(smollm2, prefix_len):
    assert _batched_vs_one_by_one(smollm2, exact=True, prefix_len=prefix_len) == 0.0


def test_smollm2_fast_mode_is_not_batch_invariant(smollm2):
    # the reason exact mode exists: llamafile's sgemm changes results with batch size
    assert _batched_vs_one_by_one(smollm2, exact=False, prefix_len=260) > 0.0


def test_exact_mode_survives_switching_back_and_forth(smollm2):
    # the llamafile switch is process-wide; each context re-asserts its own mode per decode
    assert _batched_vs_one_by_one(smollm2, exact=False, prefix_len=40) > 0.0
    assert _batched_vs_one_by_one(smollm2, exact=True, prefix_len=40) == 0.0


@pytest.mark.parametrize("prefix_len", [20, 300])
def test_gemma3_exact_mode_is_bitwise_batch_invariant(gemma3, prefix_len):
    # Gemma's Q4_K/Q6_K matmuls switch to a tiled kernel at >= 8 batch rows, which rounds
    # differently; specray's patch skips that kernel in exact mode too
    assert _batched_vs_one_by_one(gemma3, exact=True, prefix_len=prefix_len) == 0.0


def test_gemma3_fast_mode_is_not_batch_invariant(gemma3):
    assert _batched_vs_one_by_one(gemma3, exact=False, prefix_len=300) > 0.0
