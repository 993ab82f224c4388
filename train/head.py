"""The EAGLE-3 head as a torch module: the graph of llama.cpp's src/models/eagle3.cpp, op for op.

Encoder: g = fc(concat of the target's three layer inputs) (no norm before fc:
specray's heads do not set `norm_before_fc`).
Decoder (one layer), for a pair (token x, row g) at position p:

    e  = rms(embed[x]) * attn_norm          # input_layernorm on the token embedding
    gn = rms(g) * hidden_norm               # hidden_norm (blk.0.attn_norm_2) on the row
    a  = attention(wq, wk, wv on concat[e, gn], NORM rope at p, causal) -> wo
    r  = a + g                              # the residual is the raw row (norm_before_residual false)
    h  = r + ffn(rms(r) * ffn_norm)         # SiLU-gated FFN
    logits = lm_head(rms(h) * output_norm)  # draft-vocabulary rows; d2t maps row i to target token d2t[i]

`h` (llama.cpp's t_h_nextn, "prenorm") is the row fed back at the next draft
step in place of g. Rope is llama.cpp's NORM mode (adjacent dimension pairs).
Attention heads share KV heads as ggml broadcasts them: head i reads KV head
i // (n_head / n_head_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Dims:
    """Sizes the GGUF records (and the target's rope and norm settings, which the head copies)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    target_width: int  # n_embd of the target: fc reads 3 x target_width
    n_vocab: int  # the target's vocabulary (token embeddings, logits)
    draft_vocab: int  # LM-head rows (== n_vocab: no d2t)
    target_layers: tuple[int, int, int]
    rope_base: float = 10000.0
    eps: float = 1e-5
    n_ctx_train: int = 8192

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_norm(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's NORM rope on x [..., L, H, D] at positions pos [..., L]: dimension pair (2i, 2i+1) turns by
    pos * base^(-2i/D).

    >>> x = torch.tensor([[[[1.0, 0.0, 1.0, 0.0]]]])  # one position, one head, D = 4
    >>> [round(v, 4) for v in rope_norm(x, torch.tensor([[1]]), 10000.0)[0, 0, 0].tolist()]  # angles 1, 0.01
    [0.5403, 0.8415, 0.9999, 0.01]
    """
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos.to(torch.float64)[..., None] * inv).to(x.dtype)[..., None, :]  # [..., L, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Eagle3Module(nn.Module):
    """The head's weights (named as their GGUF tensors) and the pieces of its forward pass."""

    def __init__(self, d: Dims, embed: torch.Tensor, d2t: torch.Tensor | None) -> None:
        super().__init__()
        self.d = d
        n, hd = d.n_embd, d.head_dim
        q, kv = d.n_head * hd, d.n_head_kv * hd
        # the token embeddings stay the target's (frozen): the GGUF keeps the target's own bytes
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("d2t", d2t if d2t is not None else torch.arange(d.n_vocab), persistent=True)

        def mat(o: int, i: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(o, i) / i ** 0.5)

        self.fc = mat(n, 3 * d.target_width)
        self.attn_norm, self.hidden_norm = nn.Parameter(torch.ones(n)), nn.Parameter(torch.ones(n))
        self.wq, self.wk, self.wv, self.wo = mat(q, 2 * n), mat(kv, 2 * n), mat(kv, 2 * n), mat(n, q)
        self.ffn_norm = nn.Parameter(torch.ones(n))
        self.gate, self.up, self.down = mat(d.n_ff, n), mat(d.n_ff, n), mat(n, d.n_ff)
        self.output_norm = nn.Parameter(torch.ones(n))
        self.lm_head = mat(d.draft_vocab, n)

    # ---- pieces ------------------------------------------------------------------------------------
    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        """Target rows [..., 3 x target_width] -> g [..., n_embd] (the encoder graph)."""
        return feats @ self.fc.T

    def qkv(self, tokens: torch.Tensor, g: torch.Tensor, pos: torch.Tensor):
        """q [B, L, H, D], k and v [B, L, H_kv, D] of pairs (tokens [B, L], g [B, L, n]) at pos [B, L]."""
        d = self.d
        e = rms_norm(F.embedding(tokens, self.embed), self.attn_norm, d.eps)
        x = torch.cat((e, rms_norm(g, self.hidden_norm, d.eps)), dim=-1)
        b, L = tokens.shape
        q = (x @ self.wq.T).view(b, L, d.n_head, d.head_dim)
        k = (x @ self.wk.T).view(b, L, d.n_head_kv, d.head_dim)
        v = (x @ self.wv.T).view(b, L, d.n_head_kv, d.head_dim)
        return rope_norm(q, pos, d.rope_base), rope_norm(k, pos, d.rope_base), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[..., H_kv, D] -> [..., H, D]: query head i reads KV head i // (H / H_kv), as ggml broadcasts."""
        return t.repeat_interleave(self.d.n_head // self.d.n_head_kv, dim=-2)

    def finish(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Attention output [B, L, H, D] and the residual g -> the pre-norm row h [B, L, n]."""
        r = attn.flatten(-2) @ self.wo.T + g
        x = rms_norm(r, self.ffn_norm, self.d.eps)
        return r + (F.silu(x @ self.gate.T) * (x @ self.up.T)) @ self.down.T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm rows -> draft-vocabulary logits [..., draft_vocab]."""
        return rms_norm(h, self.output_norm, self.d.eps) @ self.lm_head.T

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary, -inf off the draft vocabulary (llama.cpp's d2t scatter)."""
        small = self.logits(h)
        out = torch.full((*small.shape[:-1], self.d.n_vocab), float("-inf"), dtype=small.dtype)
        out[..., self.d2t] = small
        return out

    # ---- a plain causal pass (what llama.cpp computes for a run of pairs) ------------------------
    def forward_pairs(self, tokens: torch.Tensor, g: torch.Tensor, pos0: int = 0) -> torch.Tensor:
        """Pairs (tokens [B, L], g [B, L, n]) at positions pos0..pos0+L-1, each attending to those before it
        -> pre-norm rows h [B, L, n]."""
        b, L = tokens.shape
        pos = torch.arange(pos0, pos0 + L).expand(b, L)
        q, k, v = self.qkv(tokens, g, pos)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), self.expand_kv(k).transpose(1, 2),
                                             self.expand_kv(v).transpose(1, 2), is_causal=True)
        return self.finish(att.transpose(1, 2), g)
