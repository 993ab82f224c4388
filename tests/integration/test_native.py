"""specray.native against the real SmolLM2 model: tokenizer, batches of many sequences, KV ops, state."""

from __future__ import annotations

import numpy as np
import pytest

from specray.native import lib
from specray.native.context import Context, DecodeError
from specray.native.models import resolve_model

pytestmark = pytest.mark.model


def test_build_is_amx_safe_and_has_exact_switch():
    # the project's build leaves AMX out (it segfaults here) and carries the llamafile switch
    assert not lib.build_has_amx()
    ok, why = lib.exact_mode_available()
    assert ok, why


def test_model_facts_and_tokenizer_round_trip(smollm2):
    assert smollm2.n_vocab == 49152
    assert smollm2.chat_template and "im_start" in smollm2.chat_template
    text = "Speculative decoding keeps the target's output."
    toks = smollm2.tokenize(text, add_special=False)
    assert toks.dtype == np.int32 and len(toks) > 5
    assert smollm2.detokenize(toks) == text
    assert smollm2.is_eog(smollm2.eos)


def test_chat_template_formats_messages(smollm2):
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    toks = smollm2.chat_tokens([{"role": "user", "content": "Hi there"}])
    im_start = smollm2.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and toks[0] == im_start[0]  # special tokens parsed, not spelled out


def test_chat_keeps_the_templates_default_system_prompt(smollm2):
    # SmolLM2's Jinja template opens a chat without a system message with its own;
    # llama-server and HF transformers keep it, llama.cpp's built-in chatml drops it.
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == default + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    own = smollm2.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in own


def test_template_names_and_broken_templates_use_the_builtin_formatter(caplog):
    from specray.native.model import Model

    named = Model("smollm2-135m", chat_template="chatml", vocab_only=True)
    assert named.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert named.apply_chat_template(parts) == named.apply_chat_template([{"role": "user", "content": "Hi"}])
    with caplog.at_level("WARNING"):
        broken = Model("smollm2-135m", chat_template="<|im_start|>{% for m in messages %}", vocab_only=True)
    assert "not valid Jinja" in caplog.text
    # llama.cpp recognises the family by its markers and formats it as chatml
    assert broken.apply_chat_template([{"role": "user", "content": "Hi"}]) == named.apply_chat_template(
        [{"role": "user", "content": "Hi"}]
    )
    unknown = Model("smollm2-135m", chat_template="{% for m in messages %}", vocab_only=True)
    with pytest.raises(ValueError, match="does not support the chat template"):
        unknown.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_a_template_that_refuses_the_messages_is_a_clear_error():
    from specray.native.model import Model

    strict = Model(
        "smollm2-135m", vocab_only=True,
        chat_template="{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}"
                      "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(ValueError, match="a system message comes first"):
        strict.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert strict.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "SU"


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither a packaged alias"):
        resolve_model("/nonexistent/model.gguf")


def test_batch_of_several_sequences_matches_separate_decodes(smollm2):
    ctx = Context(smollm2, n_ctx=1024, n_seq_max=3, n_batch=256, exact=True)
    prompts = [smollm2.tokenize(t) for t in ("The capital of France is", "1, 2, 3, 4,", "def add(a, b):")]
    b = ctx.batch
    b.clear()
    for s, p in enumerate(prompts):
        b.add_seq(s, p, 0, 1)
    together = ctx.decode().copy()
    assert together.shape == (3, smollm2.n_vocab)
    for s in range(3):
        assert ctx.seq_pos_max(s) == len(prompts[s]) - 1
    for s, p in enumerate(prompts):
        ctx.clear_seq(s)
        assert ctx.seq_pos_max(s) == -1
        b.clear()
        b.add_seq(s, p, 0, 1)
        alone = ctx.decode()[0]
        np.testing.assert_array_equal(alone, together[s])  # exact mode: bitwise


def test_seq_rm_rolls_back_and_state_checkpoint_restores(smollm2):
    ctx = Context(smollm2, n_ctx=512, n_seq_max=2, n_batch=128, exact=True)
    p = smollm2.tokenize("Once upon a time, in a land far away,")
    b = ctx.batch
    b.clear(); b.add_seq(0, p, 0, 1); first = ctx.decode()[0].copy()  # noqa: E702
    checkpoint = ctx.state_seq_get(0)
    extra = np.array([100, 200, 300], dtype=np.int32)
    b.clear(); b.add_seq(0, extra, len(p), 1); ctx.decode()  # noqa: E702
    assert ctx.seq_pos_max(0) == len(p) + 2
    assert ctx.seq_rm(0, len(p), -1)
    assert ctx.seq_pos_max(0) == len(p) - 1
    # the same continuation after rollback gives the same logits as before
    b.clear(); b.add_seq(0, extra[:1], len(p), 1); after_rm = ctx.decode()[0].copy()  # noqa: E702
    ctx.clear_seq(0)
    ctx.state_seq_set(1, checkpoint)  # restore into another slot
    assert ctx.seq_pos_max(1) == len(p) - 1
    b.clear(); b.add_seq(1, extra[:1], len(p), 1); after_restore = ctx.decode()[0].copy()  # noqa: E702
    np.testing.assert_array_equal(after_rm, after_restore)
    assert not np.array_equal(first, after_rm)


def test_seq_cp_shares_a_prefix(smollm2):
    # one unified KV stream: a copied prefix shares cells (per-slot streams copy them)
    ctx = Context(smollm2, n_ctx=512, n_seq_max=2, n_batch=128, exact=True, kv_unified=True)
    p = smollm2.tokenize("The quick brown fox")
    b = ctx.batch
    b.clear(); b.add_seq(0, p, 0, 0); ctx.decode()  # noqa: E702
    ctx.seq_cp(0, 1)
    assert ctx.seq_pos_max(1) == len(p) - 1
    nxt = np.array([42], dtype=np.int32)
    b.clear(); b.add_seq(0, nxt, len(p), 1); b.add_seq(1, nxt, len(p), 1)  # noqa: E702
    rows = ctx.decode()
    np.testing.assert_array_equal(rows[0], rows[1])
    ctx.seq_keep(1)
    assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == len(p)


def test_overfull_batch_is_refused(smollm2):
    ctx = Context(smollm2, n_ctx=256, n_seq_max=1, n_batch=16)
    with pytest.raises(ValueError, match="batch overflow"):
        ctx.batch.add_seq(0, np.arange(17, dtype=np.int32), 0, 1)
    ctx.batch.clear()
    with pytest.raises(DecodeError, match="empty batch"):
        ctx.decode()


def test_backend_greedy_sampling_picks_the_host_argmax_per_output_row(smollm2):
    """set_greedy_backend: llama.cpp's argmax inside the graph, several output rows per sequence (a verify's), a
    batch mixing sequences with and without a sampler (raw logits are then copied for all), and the sampler
    taken off again; each row's token equals np.argmax over the same decode's logits (a run without samplers)."""
    ctx = Context(smollm2, n_ctx=1024, n_seq_max=3, n_batch=64, outputs_per_seq=4)
    prompts = [smollm2.tokenize(t) for t in ("The capital of France is", "1, 2, 3, 4,", "def add(a, b):")]
    rows = np.array([[11, 198, 42, 7], [20, 21, 22, 23], [1030, 19, 504, 3000]], dtype=np.int32)
    b = ctx.batch

    def verify(samplers: set[int]) -> tuple[np.ndarray, np.ndarray | None]:
        for s in range(3):
            ctx.clear_seq(s)
            ctx.set_greedy_backend(s, s in samplers)
            b.clear(); b.add_seq(s, prompts[s], 0, 0); ctx.decode()  # noqa: E702
        b.clear()
        for s in range(3):
            b.add_seq(s, rows[s], len(prompts[s]), 4)
        logits = ctx.decode()
        picked = ctx.sampled_tokens([4 * s + j for s in sorted(samplers) for j in range(4)]) if samplers else None
        return (np.argmax(logits, axis=1).astype(np.int32) if len(samplers) < 3 else None), picked

    host, _ = verify(set())
    _, all_backend = verify({0, 1, 2})
    np.testing.assert_array_equal(all_backend, host)
    mixed_host, mixed = verify({1})  # seq 1 sampled in the graph, 0 and 2 read from logits in the same decode
    np.testing.assert_array_equal(mixed, host[4:8])
    np.testing.assert_array_equal(mixed_host[[0, 1, 2, 3, 8, 9, 10, 11]], host[[0, 1, 2, 3, 8, 9, 10, 11]])
    host_again, _ = verify(set())  # samplers off again: back to logits only
    np.testing.assert_array_equal(host_again, host)
    with pytest.raises(DecodeError, match="no sampled token"):
        ctx.sampled_tokens([0])
    ctx.close()
