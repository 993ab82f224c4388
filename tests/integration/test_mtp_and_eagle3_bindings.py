"""The llama-ext.h bindings (native/ext.py) resolve and return sane shapes on real (synthetic) models."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from specray.native import ext
from specray.native.context import Context
from specray.native.gguf_meta import eagle3_target_layers, meta_value
from specray.native.hidden import HiddenOutput
from specray.native.model import Model

from ..hidden_models import eagle3_draft, mtp_target

pytestmark = pytest.mark.model


def test_every_binding_resolves():
    assert ext.missing() == {}
    for name in ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_model_target_layer_ids",
                 "llama_model_target_layer_ids_n", "llama_model_get_tok_embd", "llama_model_dflash_selector_top_k",
                 "llama_set_embeddings_nextn", "llama_get_embeddings_nextn", "llama_get_embeddings_nextn_ith",
                 "llama_set_nextn_layer_offset", "llama_get_ctx_other", "llama_model_n_layer_nextn"):
        assert callable(getattr(ext, name)), name


@pytest.fixture(scope="module")
def mtp_model():
    m = Model(mtp_target("noisy"), load_mtp=True, use_extra_bufts=False)
    yield m
    m.close()


def test_nextn_model_facts_and_rows(mtp_model):
    m = mtp_model
    assert ext.n_layer_nextn(m.ptr) == 1 and llama_cpp.llama_model_n_layer(m.ptr) == 1
    assert ext.llama_model_n_embd_out(m.ptr) == m.n_embd == 64
    assert ext.target_layer_ids(m.ptr) == () and ext.llama_model_dflash_selector_top_k(m.ptr) <= 0
    n = int(ext.llama_model_get_tok_embd(m.ptr, None))
    assert n == m.n_vocab * m.n_embd
    emb = np.zeros(n, dtype=np.float32)
    assert ext.llama_model_get_tok_embd(m.ptr, emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) == n
    rms = np.sqrt((emb.reshape(m.n_vocab, m.n_embd)[:100] ** 2).mean(axis=1))
    assert np.allclose(rms, 1.0, atol=2e-3)  # the generator's unit-RMS rows (f16 in the file)

    ctx = Context(m, n_ctx=256, n_seq_max=2, n_batch=64, exact=True)
    mtp = Context(m, n_ctx=256, n_seq_max=2, n_batch=64, ctx_type=ext.LLAMA_CONTEXT_TYPE_MTP)
    try:
        assert not ext.llama_get_ctx_other(mtp.ptr)  # a glm4moe MTP context keeps its own KV cache
        ext.llama_set_nextn_layer_offset(mtp.ptr, 0)
        out = HiddenOutput(ctx, ("nextn",))
        out.set_enabled(True)
        toks = np.array([1, 504, 3458, 282, 4649], np.int32)
        ctx.batch.clear()
        ctx.batch.add_seq(0, toks, 0, 1)
        ctx.decode()
        rows = out.rows(len(toks))  # unmasked: a row for every token, not only the one with logits
        assert rows.shape == (5, 64) and np.isfinite(rows).all() and len({r.tobytes() for r in rows}) == 5
        first = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn_ith(ctx.ptr, 2), shape=(64,))
        assert np.array_equal(first, rows[2])
    finally:
        mtp.close()
        ctx.close()


def test_layer_inputs_and_eagle3_target_layers(smollm2):
    path = eagle3_draft()
    assert eagle3_target_layers(path) == (2, 15, 27) and meta_value(path, "eagle3.target_hidden_size") == 576
    d = Model(path)
    try:
        assert ext.target_layer_ids(d.ptr) == (2, 15, 27) and int(ext.llama_model_target_layer_ids_n(d.ptr)) == 3
    finally:
        d.close()
    ctx = Context(smollm2, n_ctx=256, n_seq_max=1, n_batch=64, exact=True)
    try:
        out = HiddenOutput(ctx, (2, 15, 27))
        assert out.width == 3 * 576
        out.set_enabled(True)
        toks = np.array([1, 504, 3458, 282], np.int32)
        ctx.batch.clear()
        ctx.batch.add_seq(0, toks, 0, 1)
        ctx.decode()
        rows = out.rows(len(toks))
        assert rows.shape == (4, 1728) and np.isfinite(rows).all()
        l2 = np.ctypeslib.as_array(ext.llama_get_embeddings_layer_inp(ctx.ptr, 2), shape=(4, 576))
        assert np.array_equal(rows[:, :576], l2)
        assert not np.array_equal(rows[:, :576], rows[:, 576:1152])  # different layers, different rows
        with pytest.raises(ValueError, match="nextn"):  # SmolLM2's graph has no h_nextn output
            HiddenOutput(ctx, ("nextn",))
        with pytest.raises(ValueError, match="layer id"):
            HiddenOutput(ctx, (30,))
    finally:
        ctx.close()


def test_head_batches_output_a_subset_of_their_pairs_right(mtp_model, smollm2):
    """With specray's build (native/patches/llama-eagle3-output-rows.patch and llama-nextn-masked-rows.patch)
    both heads' graphs output a subset of a batch's pairs right: the start-up probe says so, and decode() in one
    batch where only each run's last pair outputs gives what all-or-none batches give (top tokens, their
    probabilities and the output rows the next step feeds back), for a catch-up (a long run) and steady runs of
    1-2 pairs together. Unpatched, the probe failed both: eagle3's logits (relative distance 1.46) and the MTP
    graph's output rows (1.5) were another pair's."""
    from specray.native.eagle3_backend import Eagle3Head
    from specray.native.mtp_backend import MtpHead

    rng = np.random.default_rng(3)
    for head in (Eagle3Head(eagle3_draft(), smollm2, slots=3, n_ctx=512, calibrate=False),
                 MtpHead(mtp_model, slots=3, n_ctx=512, calibrate=False)):
        assert head.subset_outputs, type(head).__name__
        runs = [(s, (np.arange(n, dtype=np.int32) * 13 + 5 * s + 7) % 900,
                 0, rng.standard_normal((n, head.width)).astype(np.float32)) for s, n in enumerate((40, 1, 2))]
        got = {}
        for subset in (True, False):
            for s in range(3):
                head.ctx.clear_seq(s)
            head.subset_outputs = subset
            got[subset] = head.decode(runs)
        np.testing.assert_array_equal(got[True][0], got[False][0])
        np.testing.assert_allclose(got[True][1], got[False][1], rtol=1e-3)
        np.testing.assert_allclose(got[True][2], got[False][2], rtol=1e-3, atol=1e-3)
        head.close()
