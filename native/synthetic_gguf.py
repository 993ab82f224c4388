"""Tiny synthetic GGUFs for the hidden-state speculators (no MTP / EAGLE-3 weights exist offline).

Two writers, both borrowing a real model's vocabulary (SmolLM2's by default, so
prompts, chat templates and detokenisation work) and filling every weight with
seeded random numbers (same seed, same file):

- `write_mtp_target`: a GLM-4.5-style (`glm4moe`) target with `n_layer` trunk
  blocks and one NextN (MTP) block, an architecture the vendored llama.cpp
  runs on CPU with a DECODER_MTP graph and a plain attention KV cache.
  `mtp_head="copy_last"` makes the NextN block a copy of the last trunk block
  that ignores the hidden row (eh_proj = [I, 0]); with one trunk block and
  unit-RMS token embeddings the head then computes what the target computes,
  so its drafts are accepted (the forced-acceptance test); `copy_noise`
  perturbs the copy so that some are rejected. `"random"` gives a head whose
  drafts are almost never accepted.
- `write_eagle3_draft`: an EAGLE-3 draft (`eagle3` architecture: fc fusion of
  three target layers, one decoder layer, its own token embeddings and LM
  head) for a target such as SmolLM2-135M, reading three of its layer inputs.

Both take a fraction of a second; tests write them into a temp dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .gguf_meta import read_metadata
from .models import resolve_model

GLM4MOE = "glm4moe"
EAGLE3 = "eagle3"


@dataclass(frozen=True)
class MtpTargetSpec:
    """Shape of a synthetic glm4moe target with one NextN block."""

    n_layer: int = 1  # trunk blocks (the NextN block comes after them)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_expert: int = 2
    n_expert_used: int = 1
    n_ff_exp: int = 32
    n_ctx_train: int = 8192
    mtp_head: Literal["random", "copy_last"] = "random"
    copy_noise: float = 0.0  # copy_last: relative noise on the copied block, so some drafts are rejected
    seed: int = 0


@dataclass(frozen=True)
class Eagle3DraftSpec:
    """Shape of a synthetic EAGLE-3 draft; `target_layers` None = llama.cpp's default [2, n/2, n-3]."""

    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    target_layers: tuple[int, int, int] | None = None
    seed: int = 0


def _vocab_fields(model: str) -> list[tuple[str, int, object, int | None]]:
    """The tokenizer.* metadata (vocabulary, merges, special ids, chat template) of a GGUF."""
    return [(k, *v) for k, v in read_metadata(model).items() if k.startswith("tokenizer.")]


def _meta(model: str, key: str):
    return read_metadata(model)[key][1]


def _copy_fields(writer, fields) -> None:
    import gguf

    for key, vtype, value, sub in fields:
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))


def _write(path: str, arch: str, keys: dict, vocab_fields, tensors: dict[str, np.ndarray]) -> str:
    import gguf

    tmp = path + ".part"
    w = gguf.GGUFWriter(tmp, arch)
    for k, v in keys.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))
        else:  # pragma: no cover - a writer bug
            raise TypeError(f"{k}: {type(v)}")
    _copy_fields(w, vocab_fields)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


class _Init:
    """Seeded random weights: unit-RMS embedding rows, 1/sqrt(fan_in) projections, unit norms."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def embd(self, n_vocab: int, n_embd: int) -> np.ndarray:
        e = self.rng.standard_normal((n_vocab, n_embd), dtype=np.float32)
        return e / np.sqrt((e * e).mean(axis=1, keepdims=True))  # RMS 1: RMSNorm leaves them (almost) unchanged

    def mat(self, n_out: int, n_in: int) -> np.ndarray:
        # numpy [n_out, n_in] = ggml {n_in, n_out}: y = W x
        return (self.rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)

    def experts(self, n_expert: int, n_out: int, n_in: int) -> np.ndarray:
        return np.stack([self.mat(n_out, n_in) for _ in range(n_expert)])

    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)


def _glm4moe_block(init: _Init, s: MtpTargetSpec, head_dim: int) -> dict[str, np.ndarray]:
    """One glm4moe block (attention with Q/K/V bias, post-attention norm, MoE FFN + one shared expert)."""
    q, kv = s.n_head * head_dim, s.n_head_kv * head_dim
    return {
        "attn_norm.weight": init.ones(s.n_embd),
        "attn_q.weight": init.mat(q, s.n_embd),
        "attn_k.weight": init.mat(kv, s.n_embd),
        "attn_v.weight": init.mat(kv, s.n_embd),
        "attn_q.bias": np.zeros(q, dtype=np.float32),
        "attn_k.bias": np.zeros(kv, dtype=np.float32),
        "attn_v.bias": np.zeros(kv, dtype=np.float32),
        "attn_output.weight": init.mat(s.n_embd, q),
        "post_attention_norm.weight": init.ones(s.n_embd),
        "ffn_gate_inp.weight": init.mat(s.n_expert, s.n_embd),
        "exp_probs_b.bias": np.zeros(s.n_expert, dtype=np.float32),
        "ffn_gate_exps.weight": init.experts(s.n_expert, s.n_ff_exp, s.n_embd),
        "ffn_up_exps.weight": init.experts(s.n_expert, s.n_ff_exp, s.n_embd),
        "ffn_down_exps.weight": init.experts(s.n_expert, s.n_embd, s.n_ff_exp),
        "ffn_gate_shexp.weight": init.mat(s.n_ff_exp, s.n_embd),
        "ffn_up_shexp.weight": init.mat(s.n_ff_exp, s.n_embd),
        "ffn_down_shexp.weight": init.mat(s.n_embd, s.n_ff_exp),
    }


def write_mtp_target(path: str, spec: MtpTargetSpec = MtpTargetSpec(), vocab_from: str = "smollm2-135m") -> str:
    """Write a glm4moe target with `spec.n_layer` trunk blocks + 1 NextN block to `path`; returns path."""
    s = spec
    if s.n_embd % s.n_head or s.n_head % s.n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    if s.mtp_head == "copy_last" and s.n_layer != 1:
        raise ValueError("a copied head reproduces the target only with one trunk block (n_layer=1)")
    n_vocab = len(_meta(vocab_from, "tokenizer.ggml.tokens"))
    head_dim = s.n_embd // s.n_head
    init = _Init(s.seed)
    tensors: dict[str, np.ndarray] = {
        # f16: half the file. An LM head of its own: tied to the embeddings, a random one-block model
        # predicts the token it was fed, over and over
        "token_embd.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output_norm.weight": init.ones(s.n_embd),
    }
    blocks = [_glm4moe_block(init, s, head_dim) for _ in range(s.n_layer)]
    if s.mtp_head == "copy_last":
        nextn = {k: v.copy() for k, v in blocks[-1].items()}
        if s.copy_noise:
            for k, v in nextn.items():
                if v.ndim >= 2:
                    v += (s.copy_noise * np.abs(v).mean() * init.rng.standard_normal(v.shape)).astype(np.float32)
        eh = np.zeros((s.n_embd, 2 * s.n_embd), dtype=np.float32)
        eh[:, : s.n_embd] = np.eye(s.n_embd, dtype=np.float32)  # [enorm(e), hnorm(h)] -> e: the row is ignored
    else:
        nextn = _glm4moe_block(init, s, head_dim)
        eh = init.mat(s.n_embd, 2 * s.n_embd)
    nextn |= {"nextn.eh_proj.weight": eh, "nextn.enorm.weight": init.ones(s.n_embd),
              "nextn.hnorm.weight": init.ones(s.n_embd)}
    for i, blk in enumerate([*blocks, nextn]):
        for k, v in blk.items():
            tensors[f"blk.{i}.{k}"] = v
    a = GLM4MOE
    keys = {
        "general.name": f"specray synthetic glm4moe {s.n_layer}+1 nextn ({s.mtp_head} head)",
        f"{a}.context_length": s.n_ctx_train,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": s.n_layer + 1,
        f"{a}.nextn_predict_layers": 1,
        f"{a}.feed_forward_length": s.n_ff_exp,
        f"{a}.expert_feed_forward_length": s.n_ff_exp,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.expert_count": s.n_expert,
        f"{a}.expert_used_count": s.n_expert_used,
        f"{a}.expert_shared_count": 1,
        f"{a}.leading_dense_block_count": 0,
        f"{a}.expert_weights_scale": 1.0,
        f"{a}.expert_weights_norm": True,
        f"{a}.expert_gating_func": 2,  # sigmoid, as GLM-4.5
        f"{a}.vocab_size": n_vocab,
    }
    return _write(path, a, keys, _vocab_fields(vocab_from), tensors)


def write_eagle3_draft(path: str, spec: Eagle3DraftSpec = Eagle3DraftSpec(), target: str = "smollm2-135m") -> str:
    """Write an EAGLE-3 draft for `target` (alias or path; its vocabulary is copied) to `path`."""
    s = spec
    arch = _meta(target, "general.architecture")
    n_layer_tgt = int(_meta(target, f"{arch}.block_count"))
    n_embd_tgt = int(_meta(target, f"{arch}.embedding_length"))
    n_vocab = len(_meta(target, "tokenizer.ggml.tokens"))
    layers = s.target_layers or (2, n_layer_tgt // 2, n_layer_tgt - 3)
    if len(layers) != 3 or any(not 0 <= x < n_layer_tgt for x in layers):
        raise ValueError(f"target_layers must be 3 layer ids in [0, {n_layer_tgt}), got {layers}")
    head_dim = s.n_embd // s.n_head
    init = _Init(s.seed)
    q, kv = s.n_head * head_dim, s.n_head_kv * head_dim
    tensors = {
        "token_embd.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output.weight": (init.mat(n_vocab, s.n_embd) * np.float32(np.sqrt(s.n_embd))).astype(np.float16),
        "output_norm.weight": init.ones(s.n_embd),
        "fc.weight": init.mat(s.n_embd, 3 * n_embd_tgt),
        "blk.0.attn_norm.weight": init.ones(s.n_embd),
        "blk.0.attn_norm_2.weight": init.ones(s.n_embd),
        "blk.0.attn_q.weight": init.mat(q, 2 * s.n_embd),
        "blk.0.attn_k.weight": init.mat(kv, 2 * s.n_embd),
        "blk.0.attn_v.weight": init.mat(kv, 2 * s.n_embd),
        "blk.0.attn_output.weight": init.mat(s.n_embd, q),
        "blk.0.ffn_norm.weight": init.ones(s.n_embd),
        "blk.0.ffn_gate.weight": init.mat(s.n_ff, s.n_embd),
        "blk.0.ffn_up.weight": init.mat(s.n_ff, s.n_embd),
        "blk.0.ffn_down.weight": init.mat(s.n_embd, s.n_ff),
    }
    a = EAGLE3
    keys = {
        "general.name": f"specray synthetic eagle3 draft for {os.path.basename(resolve_model(target))}",
        f"{a}.context_length": int(_meta(target, f"{arch}.context_length")),
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": 1,
        f"{a}.feed_forward_length": s.n_ff,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.target_layers": [int(x) for x in layers],
        f"{a}.target_hidden_size": n_embd_tgt,
        f"{a}.vocab_size": n_vocab,
    }
    return _write(path, a, keys, _vocab_fields(target), tensors)


def cache_path(name: str) -> str:
    """A path under specray's model cache (~/.cache/specray/models) for a generated file."""
    from .draft_truncate import cache_dir

    return os.path.join(cache_dir(), name)
