"""A copy between KV streams (exact mode: one stream per slot) is what the cells hold at once, for every later
save and restore.

llama.cpp copies a stream's metadata at `seq_cp` but its K/V buffer only at the next decode. A save of the
copy, or a restore into its source, made before that decode would see the buffer as it was: these tests make
them in that window, and compare the next token's logits with a prefill of the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from specray.native.context import Context

pytestmark = pytest.mark.model


def _ctx(model) -> Context:
    return Context(model, n_ctx=1024, n_seq_max=3, n_batch=256, exact=True)


def _prefill(ctx: Context, seq: int, tokens: np.ndarray) -> None:
    b = ctx.batch
    b.clear(); b.add_seq(seq, tokens, 0, 1); ctx.decode()  # noqa: E702


def _next_logits(ctx: Context, seq: int, token: int, pos: int) -> np.ndarray:
    b = ctx.batch
    b.clear(); b.add_seq(seq, np.array([token], dtype=np.int32), pos, 1)  # noqa: E702
    return ctx.decode()[0].copy()


def _solo_next_logits(model, tokens: np.ndarray) -> np.ndarray:
    """The next token's logits after `tokens` prefilled alone in a fresh context: the reference."""
    ref = _ctx(model)
    _prefill(ref, 0, tokens)
    out = _next_logits(ref, 0, 11, len(tokens))
    ref.close()
    return out


def _prompts(model) -> tuple[np.ndarray, np.ndarray]:
    a = model.tokenize("The three laws of motion are the foundation of classical mechanics, and")
    b = model.tokenize("Once upon a time, in a small village by the sea, there lived a fisherman who")
    return a, b


def test_a_restore_into_the_source_of_a_pending_copy_leaves_the_copy_intact(smollm2):
    a, b = _prompts(smollm2)
    want = _solo_next_logits(smollm2, a)

    ctx = _ctx(smollm2)
    _prefill(ctx, 2, b)
    saved_b = ctx.save_seq(2)
    _prefill(ctx, 0, a)
    ctx.seq_cp(0, 1)  # a's cells into stream 1: the data moves at the next decode
    assert ctx.load_seq(0, saved_b)  # stream 0 now holds b
    got = _next_logits(ctx, 1, 11, len(a))
    ctx.close()
    assert np.array_equal(got, want)


def test_a_save_of_a_pending_copy_holds_the_copied_cells(smollm2):
    a, _ = _prompts(smollm2)
    want = _solo_next_logits(smollm2, a)

    ctx = _ctx(smollm2)
    _prefill(ctx, 0, a)
    ctx.seq_cp(0, 1)
    saved = ctx.save_seq(1)  # before any decode
    ctx.clear_seq(0)
    ctx.clear_seq(1)
    assert ctx.load_seq(2, saved)
    got = _next_logits(ctx, 2, 11, len(a))
    ctx.close()
    assert np.array_equal(got, want)


def test_a_settled_copy_keeps_the_solo_cell_layout(smollm2):
    """The copy's cut-back tail, then a prefill: bit-identical to a solo prefill of the same tokens."""
    a, _ = _prompts(smollm2)
    keep = len(a) - 5
    want = _solo_next_logits(smollm2, a)

    ctx = _ctx(smollm2)
    _prefill(ctx, 0, a)
    ctx.seq_cp(0, 1)
    ctx.seq_rm(1, keep, -1)
    ctx.save_seq(1)  # settles the copy (a decode in stream 1, then cut back)
    b = ctx.batch
    b.clear(); b.add_seq(1, a[keep:], keep, 1); ctx.decode()  # noqa: E702
    got = _next_logits(ctx, 1, 11, len(a))
    ctx.close()
    assert np.array_equal(got, want)


def test_one_kv_pool_has_nothing_to_settle(smollm2):
    """Without streams a copy is metadata only: a save right after it decodes nothing more."""
    a, _ = _prompts(smollm2)
    ctx = Context(smollm2, n_ctx=1024, n_seq_max=3, n_batch=256, exact=False)
    _prefill(ctx, 0, a)
    ctx.seq_cp(0, 1)
    decodes = ctx.n_decodes
    assert ctx.save_seq(1) is not None
    assert ctx.n_decodes == decodes
    ctx.close()


def test_a_copy_made_by_the_next_decode_is_not_settled_again(smollm2):
    a, _ = _prompts(smollm2)
    ctx = _ctx(smollm2)
    _prefill(ctx, 0, a)
    ctx.seq_cp(0, 1)
    _next_logits(ctx, 0, 11, len(a))  # any decode makes the pending copy
    decodes = ctx.n_decodes
    ctx.save_seq(1)
    assert ctx.n_decodes == decodes
    ctx.close()
