"""`specray train-head` end to end: prompts -> answers and rows -> draft vocabulary -> training -> GGUF."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np

from .config import TrainConfig
from .curve import curve_table, draw_curve
from .data import generate, load_samples
from .prompts import read_prompts
from .vocab import choose_draft_vocab, coverage, to_draft_rows


def train_head(cfg: TrainConfig, progress=print) -> dict:
    """Run everything `cfg` asks for (resuming from cfg.work_dir); returns a summary (also written to
    work_dir/summary.json)."""
    import torch

    from specray.native.models import resolve_model

    from .gguf_io import write_head
    from .init import TargetWeights, build_head, dims_for
    from .loop import Trainer

    t_start = time.monotonic()
    target = resolve_model(cfg.target)
    prompts = read_prompts(cfg.prompts, cfg.categories, cfg.exclude_categories, cfg.skip_first)
    if cfg.limit:
        prompts = prompts[: cfg.limit]
    cats = sorted({p.category for p in prompts})
    progress(f"train-head: {len(prompts)} prompts from {cfg.prompts} ({', '.join(cats)}); work dir {cfg.work_dir}")
    os.makedirs(cfg.work_dir, exist_ok=True)
    _check_same_run(cfg)
    tw = TargetWeights(target)
    n_vocab = int(tw.tensors["token_embd.weight"].shape[1])
    dims0 = dims_for(tw, cfg.shape, n_vocab, n_vocab)
    data_dir = os.path.join(cfg.work_dir, "data")
    generate(cfg, prompts, dims0.target_layers, data_dir, progress)
    samples = load_samples(data_dir)
    if len(samples) < 2:
        raise ValueError(f"only {len(samples)} answers in {data_dir}: give more prompts or a longer --gen-minutes")
    # validation scores answers only: text with no answer (long prompts, --text pieces) always trains
    answered = [s for s in samples if s.answer_from < len(s.tokens)]
    if not answered:
        raise ValueError(f"no answers in {data_dir}: give more prompts or a longer --gen-minutes")
    val, train = split_by_prompt(answered, cfg.optim.val_fraction, cfg.seed)
    train += [s for s in samples if s.answer_from >= len(s.tokens)]
    n_tokens = sum(len(s.tokens) - s.answer_from for s in train)
    if cfg.gen.learn_prompts:
        progress(f"train-head: learning on prompt positions too: {sum(len(s.tokens) for s in train)} in all")
    no_answer = [s for s in train if s.answer_from >= len(s.tokens)]
    progress(f"train-head: {len(train) - len(no_answer)} training answers ({n_tokens} answer tokens), "
             f"{len(no_answer)} texts with no answer ({sum(len(s.tokens) for s in no_answer)} tokens), {len(val)} "
             f"answers for validation (to prompts never trained on)")

    # the draft vocabulary: the target's top tokens of the training answers, most frequent first
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s in train:
        np.add.at(counts, s.labels[s.answer_from :], 1)
    vocab_path = os.path.join(cfg.work_dir, "d2t.npy")
    if cfg.shape.draft_vocab and cfg.shape.draft_vocab < n_vocab:
        if os.path.exists(vocab_path):
            d2t = np.load(vocab_path)
        else:
            d2t = choose_draft_vocab(counts, cfg.shape.draft_vocab, always=_eog_ids(cfg.target))
            np.save(vocab_path, d2t)
    else:
        d2t = None
    cov = coverage(counts, d2t) if d2t is not None else 1.0
    progress(f"train-head: draft vocabulary {len(d2t) if d2t is not None else n_vocab} tokens, covering "
             f"{100 * cov:.2f}% of the target's top tokens in the training answers")
    d = dims_for(tw, cfg.shape, n_vocab, len(d2t) if d2t is not None else n_vocab)
    model = build_head(tw, d, d2t, cfg.optim.init, cfg.seed)
    t2d = to_draft_rows(model.d2t.numpy(), n_vocab)
    trainer = Trainer(model, train, val, t2d, cfg.optim, cfg.work_dir, cfg.seed, progress, cfg.gen.learn_prompts)
    trainer.resume()
    torch.manual_seed(cfg.seed + trainer.state.step)
    state = trainer.run()
    write_head(model, cfg.out, target, tw, cfg.weight_type, name=f"specray eagle3 head for {os.path.basename(target)}")
    progress(f"train-head: wrote {cfg.out}")
    print(curve_table(state.curve))
    if cfg.curve_png:
        try:
            draw_curve(state.curve, cfg.curve_png)
            progress(f"train-head: curve drawn to {cfg.curve_png}")
        except ImportError:
            progress("train-head: no matplotlib, no curve PNG (pip install matplotlib)")
    # the point whose weights were kept (the best validation estimate), else the last
    best = trainer.best[0] if trainer.best is not None else None
    pts = [p for p in state.curve if p.get("val_accept_len") == best and p["step"] > 0] or state.curve[-1:]
    last = pts[-1] if pts else {}
    summary = {"out": cfg.out, "answers": len(samples), "train_answer_tokens": n_tokens,
               "draft_vocab": d.draft_vocab, "vocab_coverage": cov, "steps": state.step,
               "train_minutes": state.elapsed / 60, "wall_minutes": (time.monotonic() - t_start) / 60,
               "kept_step": last.get("step"), "val_acc": last.get("val_acc"),
               "val_accept_len": last.get("val_accept_len"),
               "target_layers": list(d.target_layers), "config": cfg.model_dump()}
    with open(os.path.join(cfg.work_dir, "summary.json"), "w") as f:
        json.dump({**summary, "curve": state.curve}, f, indent=1)
    return summary


def split_by_prompt(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(validation, training) samples: `fraction` of the prompts (at least one when fraction > 0, and one left to
    train on), each with all its answers, picked by `seed`.

    >>> from types import SimpleNamespace as S
    >>> val, train = split_by_prompt([S(prompt=p) for p in (0, 0, 1, 1, 2, 2)], 0.3, 0)
    >>> sorted({s.prompt for s in val}), len(val) + len(train), {s.prompt for s in val} & {s.prompt for s in train}
    ([0], 6, set())
    """
    prompts = sorted({s.prompt for s in samples})
    random.Random(seed).shuffle(prompts)
    n_val = min(max(1, round(fraction * len(prompts))), len(prompts) - 1) if fraction else 0
    held = set(prompts[:n_val])
    return [s for s in samples if s.prompt in held], [s for s in samples if s.prompt not in held]


def _eog_ids(target: str) -> tuple[int, ...]:
    """End-of-generation ids of the target (the draft vocabulary keeps them: a draft may end an answer)."""
    from specray.native.gguf_meta import read_metadata

    meta = read_metadata(target)
    return tuple(int(meta[k][1]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                 if k in meta)


def _check_same_run(cfg: TrainConfig) -> None:
    """A work dir belongs to one data recipe: resuming with other prompts or answers would mix them."""
    recipe = {"target": cfg.target, "prompts": os.path.abspath(cfg.prompts), "categories": cfg.categories,
              "exclude_categories": sorted(cfg.exclude_categories), "skip_first": cfg.skip_first, "limit": cfg.limit,
              "seed": cfg.seed,
              "gen": cfg.gen.model_dump(exclude={"minutes", "slots", "rows_minutes"}), "shape": cfg.shape.model_dump()}
    path = os.path.join(cfg.work_dir, "recipe.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = sorted(k for k in recipe if json.loads(json.dumps(recipe[k])) != old.get(k))
        if diff:
            raise ValueError(f"--work-dir {cfg.work_dir} holds a run with other settings ({', '.join(diff)}): "
                             "use another --work-dir, or the same settings to resume")
    else:
        with open(path, "w") as f:
            json.dump(recipe, f, indent=1)
