"""The training loop: length-bucketed batches, AdamW, a time budget, checkpoints, progress, the curve.

The learning rate warms up linearly, then follows a cosine to zero over
whichever ends first, the epochs or the time budget, so a run cut by its
budget still ends on a low learning rate. A checkpoint (model, optimiser,
step, elapsed time, curve, the best weights so far) is written every
`checkpoint_every` seconds and at the end; a run that finds one goes on from
it. The head kept at the end is the one with the best validation estimate of
the acceptance length (a few epochs over a small data set can overfit).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import OptimConfig
from .data import Sample
from .head import Eagle3Module
from .ttt import rollout_loss


def make_batches(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Indices grouped so that (sequences x longest length) stays within batch_tokens, similar lengths
    together (less padding), in a seeded random order.

    >>> sorted(map(sorted, make_batches([5, 100, 6, 90, 7], 200, 0)))
    [[0, 2, 4], [1, 3]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, longest = [], [], 0
    for i in order:
        n = max(longest, lengths[i])
        if cur and n * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, n = [], lengths[i]
        cur.append(i)
        longest = n
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(samples: list[Sample], t2d: np.ndarray, prompts: bool = False):
    """(feats [B, T, W] float32, tokens [B, T], draft-row labels [B, T] (-1: none), mask [B, T] of the positions
    that count: the answer's, or with `prompts` every position)."""
    b, t = len(samples), max(len(s.tokens) for s in samples)
    w = samples[0].feats.shape[1]
    feats = torch.zeros(b, t, w)
    tokens = torch.zeros(b, t, dtype=torch.int64)
    labels = torch.full((b, t), -1, dtype=torch.int64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        feats[i, :n] = torch.from_numpy(s.feats.astype(np.float32))
        tokens[i, :n] = torch.from_numpy(s.tokens.astype(np.int64))
        labels[i, :n] = torch.from_numpy(t2d[s.labels])
        mask[i, 0 if prompts else s.answer_from : n] = True
    return feats, tokens, labels, mask


def collate_soft(samples: list[Sample], t2d: np.ndarray):
    """The batch's soft labels (labels.soft_rows: draft rows [B, T, K], -1 off the draft vocabulary or padding;
    weights [B, T, K] summing to 1 where any row is on it), or None when a sample has none (data written with
    gen.soft_labels 0)."""
    if any(s.soft_ids is None for s in samples):
        return None
    from .labels import soft_rows

    b, t, k = len(samples), max(len(s.tokens) for s in samples), samples[0].soft_ids.shape[1]
    rows = torch.full((b, t, k), -1, dtype=torch.int64)
    w = torch.zeros(b, t, k)
    for i, s in enumerate(samples):
        r, p = soft_rows(s.soft_ids, s.soft_p.astype(np.float32), t2d)
        rows[i, : len(s.tokens)], w[i, : len(s.tokens)] = torch.from_numpy(r), torch.from_numpy(p)
    return rows, w


def acceptance_length(acc: list[float]) -> float:
    """Expected tokens per round of a chain of drafts whose step k is right with probability acc[k-1] given the
    steps before it were: 1 + a1 + a1 a2 + ...

    >>> acceptance_length([0.5, 0.5])
    1.75
    """
    out, p = 1.0, 1.0
    for a in acc:
        p *= a
        out += p
    return out


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed: float = 0.0  # seconds of training (all runs)
    curve: list[dict] = field(default_factory=list)


class Trainer:
    """Trains `model` on `train` samples, validating on `val`; `work_dir` holds its checkpoint."""

    def __init__(self, model: Eagle3Module, train: list[Sample], val: list[Sample], t2d: np.ndarray,
                 cfg: OptimConfig, work_dir: str, seed: int, progress=print, learn_prompts: bool = False) -> None:
        self.m, self.train, self.val, self.t2d, self.cfg = model, train, val, t2d, cfg
        self.learn_prompts = learn_prompts  # training batches count prompt positions too; validation never does
        self.soft = cfg.labels == "soft"
        self.seed, self.progress = seed, progress
        self.ckpt = os.path.join(work_dir, "checkpoint.pt")
        head = [model.lm_head]
        body = [p for p in model.parameters() if p.requires_grad and p is not model.lm_head]
        self.opt = torch.optim.AdamW([{"params": body, "scale": 1.0},
                                      {"params": head, "scale": cfg.lm_head_lr_scale}], lr=cfg.lr, weight_decay=0.0)
        self.state = TrainState()
        self.best: tuple[float, dict] | None = None  # (validation acceptance length, weights)
        self.per_epoch = len(make_batches([len(s.tokens) for s in train], cfg.batch_tokens, 0))
        self.total_steps = max(1, math.ceil(cfg.epochs * self.per_epoch))

    # ---- checkpoints -------------------------------------------------------------------------------
    def resume(self) -> bool:
        if not os.path.exists(self.ckpt):
            return False
        ck = torch.load(self.ckpt, weights_only=False)
        self.m.load_state_dict(ck["model"], strict=False)
        self.opt.load_state_dict(ck["opt"])
        self.state = TrainState(**ck["state"])
        self.best = ck.get("best")
        self.progress(f"train: resumed from {self.ckpt} at step {self.state.step} "
                      f"({self.state.elapsed / 60:.1f} min trained)")
        return True

    def save(self) -> None:
        s = self.state
        tmp = self.ckpt + ".part"
        torch.save({"model": self.m.state_dict(), "opt": self.opt.state_dict(),
                    "state": {"step": s.step, "epoch": s.epoch, "batch_in_epoch": s.batch_in_epoch,
                              "elapsed": s.elapsed, "curve": s.curve}, "best": self.best}, tmp)
        os.replace(tmp, self.ckpt)

    # ---- schedule ----------------------------------------------------------------------------------
    def done_fraction(self) -> float:
        f = self.state.step / self.total_steps
        if self.cfg.minutes:
            f = max(f, self.state.elapsed / (60 * self.cfg.minutes))
        return min(1.0, f)

    def lr(self) -> float:
        c = self.cfg
        if self.state.step < c.warmup:
            return c.lr * (self.state.step + 1) / c.warmup
        return c.lr * 0.5 * (1 + math.cos(math.pi * self.done_fraction()))

    # ---- validation --------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        if not self.val:
            return {}
        correct = np.zeros(self.cfg.ttt_steps)
        counted = np.zeros(self.cfg.ttt_steps)
        loss, n = 0.0, 0
        for idx in make_batches([len(s.tokens) for s in self.val], self.cfg.batch_tokens, 0):
            part = [self.val[i] for i in idx]
            batch = collate(part, self.t2d)
            lo, stats = rollout_loss(self.m, *batch, self.cfg.ttt_steps, self.cfg.step_decay,
                                     soft=collate_soft(part, self.t2d) if self.soft else None)
            loss, n = loss + float(lo), n + 1
            for k, (c, t) in enumerate(stats):
                correct[k] += c
                counted[k] += t
        acc = [float(c / t) if t else 0.0 for c, t in zip(correct, counted)]
        return {"val_loss": loss / max(n, 1), "val_acc": acc, "val_accept_len": acceptance_length(acc)}

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> TrainState:
        c, s = self.cfg, self.state
        if c.threads:
            torch.set_num_threads(c.threads)
        last_ckpt = last_print = time.monotonic()
        ema = None
        if not s.curve:
            s.curve.append({"step": 0, "elapsed": 0.0, "train_loss": None, **self.validate()})
            self.progress(self._line(s.curve[-1], None))
        while self.done_fraction() < 1.0:
            batches = make_batches([len(x.tokens) for x in self.train], c.batch_tokens, self.seed + s.epoch)
            if s.batch_in_epoch >= len(batches):
                s.epoch, s.batch_in_epoch = s.epoch + 1, 0
                continue
            t0 = time.monotonic()
            part = [self.train[i] for i in batches[s.batch_in_epoch]]
            batch = collate(part, self.t2d, self.learn_prompts)
            for g in self.opt.param_groups:
                g["lr"] = self.lr() * g["scale"]
            loss, _ = rollout_loss(self.m, *batch, c.ttt_steps, c.step_decay,
                                   soft=collate_soft(part, self.t2d) if self.soft else None)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.m.parameters(), 1.0)
            self.opt.step()
            s.step += 1
            s.batch_in_epoch += 1
            s.elapsed += time.monotonic() - t0
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            now = time.monotonic()
            if s.step % c.eval_every == 0 or self.done_fraction() >= 1.0:
                s.curve.append({"step": s.step, "elapsed": s.elapsed, "train_loss": ema, **self.validate()})
                self._keep_best(s.curve[-1])
                self.progress(self._line(s.curve[-1], ema))
                last_print = now
            elif now - last_print > 10:
                self.progress(self._line({"step": s.step}, ema))
                last_print = now
            if now - last_ckpt > c.checkpoint_every:
                self.save()
                last_ckpt = now
        self.save()
        if self.best is not None:
            self.m.load_state_dict(self.best[1], strict=False)
            self.progress(f"train: keeping the weights of the best validation point (est. acceptance length "
                          f"{self.best[0]:.3f})")
        return s

    def _keep_best(self, point: dict) -> None:
        score = point.get("val_accept_len")
        if score is not None and (self.best is None or score >= self.best[0]):
            self.best = (score, {k: v.detach().clone() for k, v in self.m.state_dict().items()})

    def _line(self, point: dict, ema: float | None) -> str:
        f = self.done_fraction()
        bar = "#" * int(20 * f) + "-" * (20 - int(20 * f))
        el = self.state.elapsed
        eta = el / f - el if f > 0 else float("nan")
        parts = [f"train: [{bar}] {100 * f:3.0f}% step {self.state.step}, epoch {self.state.epoch + 1}"]
        if ema is not None:
            parts.append(f"loss {ema:.3f}")
        if "val_acc" in point:
            acc = "/".join(f"{a:.2f}" for a in point["val_acc"])
            parts.append(f"val acc by step {acc}, est. acceptance length {point['val_accept_len']:.2f}")
        parts.append(f"elapsed {el / 60:.1f} min, ETA {eta / 60:.1f} min")
        return ", ".join(parts)
