"""EAGLE-3's training-time test: the head trained on the rollout it runs when it drafts.

At serve time (engine/speculators/eagle3.py) the head's KV cache holds the
committed pairs (x_{p+1}, g_p) at positions p, g_p = fc(target rows of p). A
draft from seed position s is:

    step 1: pair (x_{s+1}, g_s)          at s,       attends committed pairs 0..s    -> h1, predicts x_{s+2}
    step 2: pair (x_{s+2}, h1)           at s+1,     attends 0..s and itself         -> h2, predicts x_{s+3}
    step k: pair (x_{s+k}, h_{k-1})      at s+k-1,   attends 0..s and steps 2..k of
                                                     the same draft                  -> h_k, predicts x_{s+k+1}

`rollout` runs that for every seed position of a batch at once: step 1 is
a plain causal pass over all pairs; at step k > 1 row s's query attends the
step-1 keys of positions <= s (a causal mask) plus, one score each, the keys
its own draft made at steps 2..k (a diagonal). Tokens are the data's (a draft
step only matters if every token before it was right), rows are the head's
own, as when it drafts. Step k's label at row s is the target's top token at
position s + k.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .head import Eagle3Module


def shifted(x: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
    """x [B, T, ...] -> [B, T - 1, ...] whose row s is x[s + k] (fill past the end).

    >>> shifted(torch.tensor([[5, 6, 7, 8]]), 2).tolist()
    [[7, 8, 0]]
    """
    b, t = x.shape[:2]
    out = torch.full((b, t - 1, *x.shape[2:]), fill, dtype=x.dtype)
    n = max(0, t - k)
    out[:, :n] = x[:, k : k + n]
    return out


def rollout(m: Eagle3Module, feats: torch.Tensor, tokens: torch.Tensor, steps: int,
            start: int = 0) -> list[torch.Tensor]:
    """Pre-norm rows of each rollout step: a list of `steps` tensors; row s of step k drafted from seed
    position s (feats [B, T, 3 x target width], tokens [B, T]: x_0..x_{T-1}, right-padded). Step 1 is
    [B, T - 1, n]; steps 2.. hold the rows from `start` on only, [B, T - 1 - start, n] (a prompt's drafts are
    never scored, and a long prompt would triple the work for nothing)."""
    b, t = tokens.shape
    L = t - 1
    g = m.encode(feats[:, :L])
    pos = torch.arange(L).expand(b, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q, k1, v1 = m.qkv(shifted(tokens, 1), g, pos)
    k1e, v1e = m.expand_kv(k1).transpose(1, 2), m.expand_kv(v1).transpose(1, 2)  # [B, H, L, D]
    scale = m.d.head_dim ** -0.5
    own_k: list[torch.Tensor] = []  # [B, L', H, D]: the keys and values of steps 2.. of each row's draft
    own_v: list[torch.Tensor] = []
    out = []
    rows = slice(0, L)
    for step in range(1, steps + 1):
        if step == 2:  # from here on, rows from `start` on
            rows = slice(start, L)
            g = g[:, rows]
        if step > 1:
            q, kk, vv = m.qkv(shifted(tokens, step)[:, rows], g, pos[:, rows] + step - 1)
            own_k.append(m.expand_kv(kk))
            own_v.append(m.expand_kv(vv))
        qh = q.transpose(1, 2)  # [B, H, L', D]
        s1 = (qh @ k1e.transpose(-1, -2)) * scale
        s1 = s1.masked_fill(~causal[rows], float("-inf"))
        if own_k:
            diag = torch.stack([(q * kk).sum(-1) for kk in own_k], dim=-1).transpose(1, 2) * scale  # [B,H,L',j]
            w = torch.softmax(torch.cat((s1, diag), dim=-1), dim=-1)
            att = w[..., :L] @ v1e
            vs = torch.stack(own_v, dim=-2).transpose(1, 2)  # [B, H, L', j, D]
            att = att + (w[..., L:, None] * vs).sum(-2)
        else:
            att = torch.softmax(s1, dim=-1) @ v1e
        h = m.finish(att.transpose(1, 2), g)
        out.append(h)
        g = h  # the next step feeds this step's row back
    return out


def rollout_loss(m: Eagle3Module, feats, tokens, labels, mask, steps: int, decay: float, soft=None):
    """Weighted cross-entropy of every rollout step against the target's top tokens, or with `soft` against
    its distribution over its likeliest tokens.

    labels [B, T]: the target's top token at each position, as draft-vocabulary rows (-1: not in it, or
    padding); mask [B, T]: positions whose label counts (the answer); soft: None or (draft rows [B, T, K], -1
    off the draft vocabulary; their weights [B, T, K], loop.collate_soft). Positions count where the top
    token is in the draft vocabulary, either way, and the accuracy is the top token's. Returns (loss, per-step
    (correct, counted) pairs)."""
    first = int(mask.to(torch.int64).argmax(dim=1).min()) if bool(mask.any()) else 0
    start = max(0, first - steps)  # rows before it score nothing at any step
    total = torch.zeros(())
    weight = 0.0
    stats = []
    for k, h in enumerate(rollout(m, feats, tokens, steps, start), start=1):
        off = 0 if k == 1 else start
        y = shifted(labels, k, fill=-1)[:, off:]
        ok = shifted(mask.to(torch.int64), k, fill=0)[:, off:].bool() & (y >= 0)
        n = int(ok.sum())
        if n == 0:
            stats.append((0, 0))
            continue
        logits = m.logits(h[ok])
        yk = y[ok]
        if soft is None:
            ce = F.cross_entropy(logits, yk)
        else:  # cross-entropy against the target's probabilities: sum_j -w_j log q(row_j)
            rows = shifted(soft[0], k, fill=-1)[:, off:][ok]
            w = shifted(soft[1], k, fill=0)[:, off:][ok]
            logq = F.log_softmax(logits, dim=-1).gather(1, rows.clamp(min=0))
            ce = -(w * logq).sum(-1).mean()
        total = total + decay ** (k - 1) * ce
        weight += decay ** (k - 1)
        stats.append((int((logits.argmax(-1) == yk).sum()), n))
    return total / max(weight, 1e-9), stats
