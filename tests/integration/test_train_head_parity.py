"""The trainer's torch head computes what llama.cpp's eagle3 graph computes, on SmolLM2's real rows.

One head (LM head from SmolLM2's tied embedding, the rest seeded random, norms
away from 1) is written by specray.train's GGUF writer, read back (weights as
stored: f16 rounding included), and fed the same inputs as the `eagle3`
speculator's backend (native/eagle3_backend.py) gets: SmolLM2's inputs of
layers 2, 15, 27 of a real chat prompt, through the encoder (fc), then the
committed pairs (x_{p+1}, g_p), then a 3-step draft from seed position s with
each step's own output row fed back. Compared: the fc rows, the pre-norm rows,
and the logits over the whole vocabulary (with `d2t`: -inf off the draft
vocabulary, at the same places) of every pair, and the rollout's (train/ttt.py)
steps 2 and 3 against the draft steps llama.cpp runs.

Tolerance: |torch - llama.cpp| <= 0.002 x the largest |logit| + 0.05, and the
same top token everywhere. llama.cpp keeps K and V in f16, rounds a matmul's
input to f16 for f16 weights and to 8 bits per block of 32 for q8_0 weights
(the default export). Measured here, the largest difference per step (pairs,
draft step 2, draft step 3): 0.00016, 0.00004, 0.00005 with f32 weights and
the whole vocabulary; 0.0013, 0.0009, 0.0011 with f16 weights and a
4096-token d2t; 0.041, 0.022, 0.028 with q8_0 and an 8192-token d2t (this
head's logits are within about +-10).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ..conftest import spec_bench_prompts  # noqa: E402
from ..hidden_models import solo_rows  # noqa: E402

pytestmark = pytest.mark.model


def _logit_tol(ref: np.ndarray) -> float:
    return 0.002 * float(np.abs(ref[np.isfinite(ref)]).max()) + 0.05


def _check_logits(ours: np.ndarray, theirs: np.ndarray) -> float:
    fin = np.isfinite(ours)
    assert np.array_equal(fin, np.isfinite(theirs)), "d2t: -inf at different places"
    diff = float(np.abs(ours[fin] - theirs[fin]).max())
    assert diff <= _logit_tol(theirs), diff
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    return diff


@pytest.mark.parametrize("draft_vocab,weight_type", [(0, "f32"), (4096, "f16"), (8192, "q8_0")])
def test_torch_head_matches_llama_cpp_eagle3_graph(smollm2, tmp_path, draft_vocab, weight_type):
    import llama_cpp

    from specray.native import ext
    from specray.native.eagle3_backend import Eagle3Head
    from specray.native.models import resolve_model
    from specray.train.config import HeadShape
    from specray.train.gguf_io import read_head, write_head
    from specray.train.init import TargetWeights, build_head, dims_for
    from specray.train.ttt import rollout

    target = resolve_model("smollm2-135m")
    tw = TargetWeights(target)
    n_vocab = smollm2.n_vocab
    rng = np.random.default_rng(0)
    d2t = np.sort(rng.choice(n_vocab, draft_vocab, replace=False)) if draft_vocab else None
    d = dims_for(tw, HeadShape(), n_vocab, draft_vocab or n_vocab)
    m0 = build_head(tw, d, d2t, "target", seed=1)
    with torch.no_grad():
        for name in ("attn_norm", "hidden_norm", "ffn_norm"):
            getattr(m0, name).add_(0.1 * torch.randn(d.n_embd))
    path = write_head(m0, str(tmp_path / "head.gguf"), target, tw, weight_type)
    m = read_head(path)
    assert m.d == d and torch.equal(m.d2t, m0.d2t)

    toks = np.asarray(smollm2.chat_tokens([{"role": "user", "content": spec_bench_prompts(1)[0]}]), dtype=np.int32)
    toks = toks[:48]
    T = len(toks)
    rows = solo_rows(smollm2, d.target_layers, [toks], n_ctx=512, slots=1)[0]
    head = Eagle3Head(path, smollm2, slots=1, n_ctx=512, calibrate=False)
    try:
        assert head.taps == d.target_layers
        L = T - 1
        g = head.encode(rows[:L])
        with torch.no_grad():
            g_t = m.encode(torch.from_numpy(rows[:L])).numpy()
        assert np.abs(g - g_t).max() <= 1e-3 * np.abs(g).max()

        def run(tokens, pos0, g_rows):
            b = head.batch
            b.clear()
            b.add_pairs(0, np.asarray(tokens, dtype=np.int32), pos0, g_rows, len(tokens))
            b.process()
            n = len(tokens)
            lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits(head.ctx.ptr), shape=(n, n_vocab)).copy()
            hid = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(head.ctx.ptr), shape=(n, d.n_embd)).copy()
            return lg, hid

        # the committed pairs (x_{p+1}, g_p) at p = 0..L-1, every one with an output
        lg1, hid1 = run(toks[1:], 0, g)
        with torch.no_grad():
            h_t = m.forward_pairs(torch.from_numpy(toks[1:].astype(np.int64))[None], torch.from_numpy(g)[None])
            ours1 = m.full_logits(h_t)[0].numpy()
            steps = rollout(m, torch.from_numpy(rows)[None], torch.from_numpy(toks.astype(np.int64))[None], 3)
        diffs = [_check_logits(ours1, lg1)]
        assert np.abs(h_t[0].numpy() - hid1).max() <= 1e-3 * np.abs(hid1).max()
        # the rollout's step 1 is the causal pass (on its own fc rows, so within the fc tolerance)
        assert float((steps[0][0] - h_t[0]).abs().max()) <= 1e-3 * float(h_t.abs().max())

        # the speculator's own call (PairHead.decode): a catch-up run whose last pair alone is read. Its output
        # must be the last pair's: with llama.cpp choosing a subset of the batch as outputs it was the first
        # pairs' (a trained head drafted token 198 on every chat prompt)
        for n in (2, 5, L):  # L: a catch-up, its pairs before the last decoded first with no outputs
            head.seq_rm(0, 0)
            top, _, hid = head.decode([(0, toks[1 : n + 1], 0, g[:n])])
            want = h_t[0, n - 1].numpy()
            # a 2-pair batch takes other kernels than the 47-pair one above: 1.2e-3 of the largest value measured;
            # another pair's row is off by the same order as the row itself
            assert np.abs(hid[0] - want).max() <= 5e-3 * np.abs(want).max(), n
            assert int(top[0]) == int(np.argmax(ours1[n - 1])), n
        head.seq_rm(0, 0)
        run(toks[1:], 0, g)

        # a 3-step draft from seed s, as the speculator runs it: the KV keeps pairs 0..s, then each step's pair
        s = T - 4
        head.ctx.seq_rm(0, s + 1)
        row = hid1[s : s + 1]
        for k in (2, 3):
            lg, hid = run(toks[s + k : s + k + 1], s + k - 1, row)
            with torch.no_grad():
                ours = m.full_logits(steps[k - 1][0, s : s + 1]).numpy()
            diffs.append(_check_logits(ours, lg))
            row = hid
        print(f"\nparity ({weight_type}, draft vocab {draft_vocab or n_vocab}): max |logit diff| by step {diffs}")
    finally:
        head.close()
        head.model.close()
