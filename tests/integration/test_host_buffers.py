"""Host-tier saves into reused buffers (native/host_memory.py): a buffer a dropped save gives back holds the
next save's cells, and they restore to what a prefill of the same tokens gives, bit for bit (exact mode)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.native.context import Context

pytestmark = pytest.mark.model

TEXT_A = ("The three laws of motion are the foundation of classical mechanics. The first law says that a body at "
          "rest stays at rest, and a body in motion stays in motion, unless a force acts on it. ") * 4
TEXT_B = ("Once upon a time, in a small village by the sea, there lived a fisherman who went out every morning "
          "before dawn and came back at noon with his nets full of silver fish. ") * 4


def _ctx(model) -> Context:
    return Context(model, n_ctx=1024, n_seq_max=3, n_batch=256, exact=True)


def _prefill(ctx: Context, seq: int, tokens: np.ndarray) -> None:
    b = ctx.batch
    b.clear(); b.add_seq(seq, tokens, 0, 1); ctx.decode()  # noqa: E702


def _next_logits(ctx: Context, seq: int, pos: int) -> np.ndarray:
    b = ctx.batch
    b.clear(); b.add_seq(seq, np.array([11], dtype=np.int32), pos, 1)  # noqa: E702
    return ctx.decode()[0].copy()


def test_a_recycled_buffer_holds_the_next_save_exactly(smollm2):
    a = smollm2.tokenize(TEXT_A)[:130]
    b = smollm2.tokenize(TEXT_B)[:115]  # fits in a's buffer within the pool's slack
    ref = _ctx(smollm2)
    _prefill(ref, 0, b)
    want = _next_logits(ref, 0, len(b))
    ref.close()

    ctx = _ctx(smollm2)
    _prefill(ctx, 0, a)
    saved_a = ctx.save_seq(0)
    ctx.recycle(saved_a)  # the host tier dropped it
    _prefill(ctx, 1, b)
    saved_b = ctx.save_seq(1)
    assert saved_b.buffer is saved_a.buffer and ctx.saved_buffers.reused == 1
    assert saved_b.n_bytes < len(saved_b), "b's cells fill part of a's buffer"
    ctx.clear_seq(0)
    ctx.clear_seq(1)
    assert ctx.load_seq(2, saved_b)
    got = _next_logits(ctx, 2, len(b))
    ctx.close()
    assert np.array_equal(got, want)


def test_a_save_too_small_for_a_kept_buffer_gets_its_own(smollm2):
    a = smollm2.tokenize(TEXT_A)[:130]
    ctx = _ctx(smollm2)
    _prefill(ctx, 0, a)
    saved_a = ctx.save_seq(0)
    ctx.recycle(saved_a)
    _prefill(ctx, 1, a[:60])  # under 1 / POOL_SLACK of a's buffer: the kept one would hold memory it does not use
    saved = ctx.save_seq(1)
    assert saved.buffer is not saved_a.buffer and ctx.saved_buffers.reused == 0
    assert ctx.saved_buffers.held_bytes == len(saved_a)
    ctx.close()
