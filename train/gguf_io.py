"""The trained head as an EAGLE-3 draft GGUF (llama.cpp's eagle3 layout), and read back into torch.

Tensors (numpy [n_out, n_in] = ggml {n_in, n_out}), as src/models/eagle3.cpp loads them:
`fc.weight`, `blk.0.{attn_norm, attn_norm_2, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
ffn_down}.weight`, `output_norm.weight`, `output.weight` (draft-vocabulary rows), `token_embd.weight` (the
target's own bytes: the head keeps the target's embeddings) and, with a reduced vocabulary, `d2t` (int64,
draft row -> absolute target token id). Metadata: the target's vocabulary, `eagle3.target_layers`,
`eagle3.target_hidden_size`, rope base and norm epsilon copied from the target.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from specray.native.synthetic_gguf import EAGLE3, head_keys, vocab_fields, write_gguf

from .head import Dims, Eagle3Module
from .init import TargetWeights

#: module attribute -> GGUF tensor name
TENSOR_NAMES = {
    "fc": "fc.weight", "attn_norm": "blk.0.attn_norm.weight", "hidden_norm": "blk.0.attn_norm_2.weight",
    "wq": "blk.0.attn_q.weight", "wk": "blk.0.attn_k.weight", "wv": "blk.0.attn_v.weight",
    "wo": "blk.0.attn_output.weight", "ffn_norm": "blk.0.ffn_norm.weight", "gate": "blk.0.ffn_gate.weight",
    "up": "blk.0.ffn_up.weight", "down": "blk.0.ffn_down.weight", "output_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


WEIGHT_TYPES = ("q8_0", "f16", "f32")


def write_head(m: Eagle3Module, path: str, target: str, tw: TargetWeights, weight_type: str = "q8_0",
               name: str | None = None) -> str:
    """Write `m` to `path` (atomically). Matrices as `weight_type` (q8_0, f16 or f32; a head step on a CPU
    reads every weight once, so q8_0 halves what f16 costs); norms f32. fc stays f16 with q8_0: llama.cpp
    quantizes a q8_0 matmul's input to 8 bits per block of 32, and the target rows fc reads have outliers
    (SmolLM2's reach 2.5e4 among values of a few hundred), which that crushes."""
    import gguf
    from gguf.quants import quantize

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight type must be one of {', '.join(WEIGHT_TYPES)}, got {weight_type!r}")
    d = m.d
    tensors: dict = {}
    for attr, tname in TENSOR_NAMES.items():
        a = getattr(m, attr).detach().to(torch.float32).numpy()
        if a.ndim == 1 or weight_type == "f32":
            tensors[tname] = a.astype(np.float32)
        elif weight_type == "f16" or attr == "fc":
            tensors[tname] = a.astype(np.float16)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            tensors[tname] = (quantize(np.ascontiguousarray(a), q8), q8)
    tensors["token_embd.weight"] = tw.raw("token_embd.weight")
    if d.draft_vocab != d.n_vocab:
        tensors["d2t"] = m.d2t.numpy().astype(np.int64)
    spec = _Spec(d.n_ff, d.n_head, d.n_head_kv)
    a = EAGLE3
    keys = {
        "general.name": name or f"specray eagle3 head for {os.path.basename(target)}",
        **head_keys(a, target, tw.arch, d.n_embd, 1, spec, d.head_dim, d.target_layers, d.n_vocab),
        f"{a}.attention.layer_norm_rms_epsilon": float(d.eps),
        f"{a}.rope.freq_base": float(d.rope_base),
        f"{a}.target_hidden_size": d.target_width,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_gguf(path, a, keys, vocab_fields(target), tensors)


class _Spec:
    """What head_keys reads from a synthetic spec."""

    def __init__(self, n_ff: int, n_head: int, n_head_kv: int) -> None:
        self.n_ff, self.n_head, self.n_head_kv = n_ff, n_head, n_head_kv


def read_head(path: str) -> Eagle3Module:
    """An EAGLE-3 GGUF (as written by write_head) back as a torch module, weights as stored."""
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(path)
    f = r.fields

    def key(k):
        return f[f"{EAGLE3}.{k}"].contents()

    t = {x.name: x for x in r.tensors}

    def get(name: str) -> np.ndarray:
        x = t[name]
        return np.array(dequantize(x.data, x.tensor_type), dtype=np.float32).reshape(
            [int(s) for s in reversed(x.shape)])

    embed = torch.from_numpy(get("token_embd.weight"))
    d2t = torch.from_numpy(np.asarray(t["d2t"].data, dtype=np.int64).copy()) if "d2t" in t else None
    n_vocab = embed.shape[0]
    lm = get("output.weight")
    d = Dims(n_embd=int(key("embedding_length")), n_head=int(key("attention.head_count")),
             n_head_kv=int(key("attention.head_count_kv")), n_ff=int(key("feed_forward_length")),
             target_width=int(key("target_hidden_size")), n_vocab=n_vocab, draft_vocab=lm.shape[0],
             target_layers=tuple(int(x) for x in key("target_layers")),  # type: ignore[arg-type]
             rope_base=float(key("rope.freq_base")), eps=float(key("attention.layer_norm_rms_epsilon")),
             n_ctx_train=int(key("context_length")))
    m = Eagle3Module(d, embed, d2t)
    with torch.no_grad():
        for attr, tname in TENSOR_NAMES.items():
            getattr(m, attr).copy_(torch.from_numpy(get(tname)))
    return m
