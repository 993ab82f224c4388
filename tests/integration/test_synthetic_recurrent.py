"""Synthetic recurrent (Mamba-2) and hybrid (LFM2) targets: what rolling back a rejected draft does to them.

A pure Mamba-2 target has no n_rs_seq snapshots in this llama.cpp (it clamps
the request to 0), so a partial seq_rm is refused and the only way back is a
saved state (SeqCheckpoints) plus replay. LFM2 has them: seq_rm of the last
few tokens is accepted and the next decode starts from the snapshot. Either
way the next token's logits must be those of a run that never saw the
rejected tokens.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specray.native.checkpoints import SeqCheckpoints
from specray.native.context import Context
from specray.native.model import Model
from specray.native.synthetic_gguf import (
    HybridTargetSpec,
    RecurrentTargetSpec,
    write_hybrid_target,
    write_recurrent_target,
)

pytestmark = pytest.mark.model

KINDS = ("recurrent", "hybrid")
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
DRAFT = [504, 3458, 282, 4649]  # four tokens decoded after the prompt, some of them then rejected
NEXT = 30  # the token decoded after a rollback


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic-recurrent")
    return {"recurrent": write_recurrent_target(str(d / "mamba2.gguf")),
            "hybrid": write_hybrid_target(str(d / "lfm2.gguf"))}


@pytest.fixture(scope="module")
def models(paths):
    ms = {k: Model(p, use_extra_bufts=False) for k, p in paths.items()}
    yield ms
    for m in ms.values():
        m.close()


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def context(model, n_rs_seq: int = 0) -> Context:
    # exact mode: a row's logits do not depend on how many tokens share its batch, so a run that decoded a
    # draft in one batch and rolled part of it back compares bitwise with one that decoded token by token
    return Context(model, n_ctx=512, n_seq_max=2, n_batch=64, exact=True, n_rs_seq=n_rs_seq)


def decode(ctx: Context, tokens, pos0: int, n_logits: int = 1, seq: int = 0) -> np.ndarray:
    ctx.batch.clear()
    ctx.batch.add_seq(seq, np.asarray(tokens, dtype=np.int32), pos0, n_logits)
    return ctx.decode().copy()


def reference(model, prompt, kept, n_rs_seq: int = 0) -> np.ndarray:
    """Logits of NEXT after the prompt and the `kept` tokens, decoded one at a time: no rollback."""
    ctx = context(model, n_rs_seq)
    try:
        decode(ctx, prompt, 0)
        for i, t in enumerate(kept):
            decode(ctx, [t], len(prompt) + i)
        return decode(ctx, [NEXT], len(prompt) + len(kept))[0]
    finally:
        ctx.close()


def test_memory_kind_and_files(paths, models, tmp_path):
    assert models["recurrent"].memory_kind == "recurrent"
    assert models["hybrid"].memory_kind == "hybrid"
    for m in models.values():
        assert m.n_embd == 64 and m.n_vocab == 49152  # SmolLM2's vocabulary
        assert m.detokenize(m.tokenize(PROMPT, add_special=False)) == PROMPT
    # same seed, same bytes; another seed, another file
    assert open(write_recurrent_target(str(tmp_path / "r.gguf")), "rb").read() == open(paths["recurrent"], "rb").read()
    assert open(write_hybrid_target(str(tmp_path / "h.gguf")), "rb").read() == open(paths["hybrid"], "rb").read()
    other = write_hybrid_target(str(tmp_path / "h1.gguf"), HybridTargetSpec(seed=1))
    assert open(other, "rb").read() != open(paths["hybrid"], "rb").read()


def test_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="attn_layers"):
        write_hybrid_target(str(tmp_path / "x.gguf"), HybridTargetSpec(attn_layers=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match="d_inner"):
        write_recurrent_target(str(tmp_path / "x.gguf"), RecurrentTargetSpec(n_head=7))


def test_greedy_decode_is_finite_and_loops(models, kind):
    m = models[kind]
    ctx = context(m)
    try:
        prompt = m.tokenize(PROMPT)
        logits = decode(ctx, prompt, 0)
        out = []
        for i in range(48):
            assert np.isfinite(logits).all()
            out.append(int(np.argmax(logits[-1])))
            logits = decode(ctx, [out[-1]], len(prompt) + i)
        # the LM head's successor cycles: greedy decoding ends in a loop of period loop_len
        p = RecurrentTargetSpec().loop_len
        assert out[-3 * p:] == out[-2 * p:] + out[-p:], m.detokenize(out)
        assert len(set(out[-p:])) == p
    finally:
        ctx.close()


def test_n_rs_seq_reads_back(models):
    for kind, want in (("recurrent", 0), ("hybrid", 4)):  # no rollback snapshots for mamba2: clamped to 0
        ctx = context(models[kind], n_rs_seq=4)
        try:
            assert ctx.n_rs_seq == want, kind
        finally:
            ctx.close()


def test_partial_seq_rm_refused_without_snapshots(models, kind):
    ctx = context(models[kind])
    try:
        prompt = models[kind].tokenize(PROMPT)
        n = len(prompt)
        decode(ctx, prompt, 0)
        for p in (1, n // 2, n - 1):
            assert not ctx.seq_rm(0, p, -1), p
            assert ctx.seq_pos_max(0) == n - 1  # refused: nothing removed (the hybrid's attention KV neither)
        assert ctx.seq_rm(0, -1, -1)
        assert ctx.seq_pos_max(0) == -1
        decode(ctx, prompt, 0)  # the emptied sequence starts again
        assert ctx.seq_pos_max(0) == n - 1
    finally:
        ctx.close()


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_hybrid_rollback_matches_a_run_without_the_draft(models, keep):
    m = models["hybrid"]
    prompt = m.tokenize(PROMPT)
    n = len(prompt)
    ctx = context(m, n_rs_seq=4)
    try:
        decode(ctx, prompt, 0)
        decode(ctx, DRAFT, n, n_logits=len(DRAFT))
        assert ctx.seq_rm(0, n + keep, -1)  # keep DRAFT[:keep], drop the rest
        assert ctx.seq_pos_max(0) == n + keep - 1
        assert not ctx.seq_rm(0, n + keep - 1, -1)  # a rollback is pending: no second one before a decode
        got = decode(ctx, [NEXT], n + keep)[0]
    finally:
        ctx.close()
    want = reference(m, prompt, DRAFT[:keep], n_rs_seq=4)
    np.testing.assert_array_equal(got, want)


def test_hybrid_rollback_is_bounded_by_n_rs_seq(models):
    m = models["hybrid"]
    prompt = m.tokenize(PROMPT)
    n = len(prompt)
    ctx = context(m, n_rs_seq=2)
    try:
        decode(ctx, prompt, 0)
        decode(ctx, DRAFT, n, n_logits=1)
        assert not ctx.seq_rm(0, n + 1, -1)  # 3 tokens back: more than the 2 snapshots
        assert ctx.seq_rm(0, n + 2, -1)  # 2 back: fine
    finally:
        ctx.close()


@pytest.mark.parametrize("split,keep", [((1, 1), 1), ((3, 1), 2), ((2, 2), 1)])
def test_hybrid_rollback_cannot_reach_past_the_last_decode(models, split, keep):
    """The snapshots are written by the last decode only (one per token, the newest n_rs_seq + 1): a rollback
    into an earlier decode is accepted by seq_rm, within n_rs_seq, and restores a stale snapshot. The engine
    must roll back only tokens of the last decode, keeping at least its first token (verify = [last accepted
    token, drafts...] does). If llama.cpp starts refusing these, or gets them right, this test says so."""
    m = models["hybrid"]
    prompt = m.tokenize(PROMPT)
    n = len(prompt)
    ctx = context(m, n_rs_seq=4)
    try:
        decode(ctx, prompt, 0)
        i = 0
        for k in split:
            decode(ctx, DRAFT[i : i + k], n + i, n_logits=1)
            i += k
        assert i - keep >= split[-1]  # the rollback removes the whole last decode, and more
        assert ctx.seq_rm(0, n + keep, -1)
        got = decode(ctx, [NEXT], n + keep)[0]
    finally:
        ctx.close()
    assert np.abs(got - reference(m, prompt, DRAFT[:keep], n_rs_seq=4)).max() > 1.0


def test_checkpoint_restore_matches_a_run_without_the_draft(models, kind):
    m = models[kind]
    prompt = m.tokenize(PROMPT)
    n = len(prompt)
    ctx = context(m)
    cps = SeqCheckpoints(ctx)
    try:
        decode(ctx, prompt, 0)
        size = cps.save(0)
        assert size == cps.nbytes > 0
        decode(ctx, DRAFT[:3], n, n_logits=3)
        cps.restore(0)
        assert ctx.seq_rm(0, n, -1)  # the recurrent part is back at n - 1: this trims the hybrid's attention KV
        assert ctx.seq_pos_max(0) == n - 1
        got = decode(ctx, [NEXT], n)[0]
        assert cps.save(0) == size  # a second save reuses the buffer: the state does not grow with the context
    finally:
        ctx.close()
    np.testing.assert_array_equal(got, reference(m, prompt, []))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specray.native.synthetic_gguf", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_models(paths, tmp_path):
    for kind, name in (("recurrent", "mamba2"), ("hybrid", "lfm2")):
        out = tmp_path / f"{name}.gguf"
        r = cli("--kind", kind, "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(out)
        assert out.read_bytes() == open(paths[kind], "rb").read()  # the default seed, as the writers
    r = cli("--kind", "hybrid", "--out", str(tmp_path / "s1.gguf"), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s1.gguf").read_bytes() != open(paths["hybrid"], "rb").read()


def test_cli_rejects_a_bad_kind(tmp_path):
    r = cli("--kind", "transformer", "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2
    assert "--kind" in r.stderr and "invalid choice" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
