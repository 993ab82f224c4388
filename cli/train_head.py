"""`specray train-head`: its flags, their mapping onto specray.train's TrainConfig, and the command."""

from __future__ import annotations

import argparse
import sys

#: TrainConfig field (dotted) -> flag, for the flags' help and their errors
FLAGS = {
    "target": "--target", "prompts": "--prompts", "categories": "--categories",
    "exclude_categories": "--exclude-categories", "skip_first": "--skip-first", "limit": "--limit", "out": "--out", "work_dir": "--work-dir",
    "curve_png": "--curve", "seed": "--seed", "threads": "--threads", "weight_type": "--weight-type",
    "shape.draft_vocab": "--draft-vocab", "shape.target_layers": "--target-layers",
    "gen.max_tokens": "--max-tokens", "gen.sampled": "--sampled", "gen.temperature": "--temperature",
    "gen.slots": "--gen-slots", "gen.self_prompts": "--self-prompts", "gen.minutes": "--gen-minutes",
    "gen.max_len": "--max-len", "gen.learn_prompts": "--learn-prompts",
    "gen.max_prompt": "--max-prompt-tokens", "gen.soft_labels": "--soft-labels", "gen.text": "--text",
    "gen.rows_minutes": "--rows-minutes", "optim.labels": "--labels",
    "optim.epochs": "--epochs", "optim.minutes": "--minutes", "optim.lr": "--lr", "optim.warmup": "--warmup",
    "optim.lm_head_lr_scale": "--lm-head-lr-scale",
    "optim.batch_tokens": "--batch-tokens", "optim.ttt_steps": "--ttt-steps", "optim.init": "--init",
    "optim.eval_every": "--eval-every", "optim.val_fraction": "--val-fraction",
    "optim.checkpoint_every": "--checkpoint-every", "optim.threads": "--torch-threads",
}

DESCRIPTION = """\
Train an EAGLE-3 draft head for a target on the target's own answers (self-distillation), and write it as an
eagle3 GGUF that the `eagle3` speculator serves (--eagle3-model, or engine.hidden.eagle3_model in a config):

  1. answers: every prompt through specray's engine, greedy and --sampled times sampled;
  2. rows: the target's inputs of the head's three layers (--target-layers) and its top token, per position;
  3. draft vocabulary: the --draft-vocab most frequent top tokens (the GGUF's d2t);
  4. training with the multi-step rollout (EAGLE-3's training-time test, --ttt-steps), the LM head starting
     from the target's own rows (--init target), for --epochs or --minutes, whichever ends first;
  5. the GGUF, the learning curve (printed; --curve draws it).

Everything lands in --work-dir (default OUT.work): data shards, d2t.npy, checkpoint.pt, summary.json. Run the
same command again to resume (a finished run only re-exports). Needs torch: pip install -e ".[train]".

  specray train-head --exclude-categories writing,roleplay,humanities,coding \\
      --gen-minutes 8 --minutes 30 --out head.gguf --curve head.png
  specray bench --eagle3-model head.gguf --configs none eagle3 ngram_mod,suffix,ngram_cache,grammar,eagle3
"""


def _csv(text: str) -> list[str]:
    return [c for c in text.split(",") if c]


def _layers(text: str) -> tuple[int, int, int]:
    try:
        v = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three layer ids like 2,15,27, got {text!r}") from None
    if len(v) != 3:
        raise argparse.ArgumentTypeError(f"expected three layer ids like 2,15,27, got {text!r}")
    return v  # type: ignore[return-value]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train-head", help="train an EAGLE-3 head for the target on its own answers (needs torch)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model: alias or .gguf (default: %(default)s)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="prompts: 'prompt', 'messages' or Spec-Bench 'turns' per line, optional 'category' "
                        "(default: $SPECRAY_SPEC_BENCH, else Spec-Bench's questions shipped in the package, "
                        "bench/data/spec_bench.jsonl)")
    p.add_argument("--out", required=True, metavar="HEAD.gguf", help="the trained head (eagle3 GGUF)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="data, checkpoints and summary; a second run resumes from it (default: OUT.work)")
    p.add_argument("--curve", default=None, metavar="PNG", help="draw the learning curve to this image file")
    p.add_argument("--seed", type=int, default=0, help="prompt order, sampling, initialisation, batches (default 0)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads while generating (default 2)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: torch's)")
    d = p.add_argument_group("data")
    d.add_argument("--categories", type=_csv, default=None, help="train on these categories only, comma-separated")
    d.add_argument("--exclude-categories", type=_csv, default=[],
                   help="never train on these, comma-separated (keep them for measuring)")
    d.add_argument("--skip-first", type=int, default=0, metavar="N",
                   help="leave out the first N prompts of every category: `specray bench --per-category N` "
                        "then measures on prompts the head never saw (default 0)")
    d.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    d.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    d.add_argument("--sampled", type=int, default=1, help="sampled answers per prompt besides the greedy one "
                                                          "(default 1)")
    d.add_argument("--temperature", type=float, default=0.8, help="temperature of sampled answers (default 0.8)")
    d.add_argument("--gen-slots", type=int, default=8, help="answers generated at once (default 8)")
    d.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="first have the target write N user messages of its own (its chat template up to a user "
                        "turn, sampled at --temperature; Magpie), then answer them with the file's prompts: chat "
                        "prompts with no data set and none of the measured ones (default 0)")
    d.add_argument("--gen-minutes", type=float, default=None,
                   help="stop generating answers after this long; the order is shuffled, so a cut still covers "
                        "every category (default: no limit, all of them)")
    d.add_argument("--max-prompt-tokens", type=int, default=384, metavar="N",
                   help="skip prompts longer than N tokens, 0: none (a long prompt is decoded twice for one "
                        "answer; default 384)")
    d.add_argument("--learn-prompts", action="store_true",
                   help="the head also learns on the prompts' positions (the target's top token after text it did "
                        "not write, as EAGLE trained on a fixed data set), and a prompt over --max-prompt-tokens is "
                        "kept without an answer instead of skipped: a prefill's worth of data, not a generation's")
    d.add_argument("--text", action="append", default=[], metavar="GLOB",
                   help="plain-text files (a glob; ** recursive; repeatable) cut into --max-len-token pieces the "
                        "head learns on with no answer, the target's top tokens as labels (needs --learn-prompts): "
                        "a prefill's worth of data, about three times the positions a minute of answers makes")
    d.add_argument("--rows-minutes", type=float, default=None, metavar="M",
                   help="spend the first M minutes of --gen-minutes on text with no answer (--text, and prompts "
                        "over --max-prompt-tokens); default: that text only after the answers, with what is left")
    d.add_argument("--soft-labels", type=int, default=0, metavar="K",
                   help="also keep the target's K likeliest tokens and their probabilities at each position, for "
                        "--labels soft (default 0: its top token only)")
    d.add_argument("--max-len", type=int, default=1024, help="tokens per training sequence; a longer prompt keeps "
                                                             "its end (default 1024)")
    h = p.add_argument_group("head and training")
    h.add_argument("--draft-vocab", type=int, default=8192,
                   help="LM-head rows: the most frequent target tokens of the answers (0: the whole vocabulary, no "
                        "d2t; default 8192)")
    h.add_argument("--target-layers", type=_layers, default=None, metavar="A,B,C",
                   help="the three target layers the head reads (default: llama.cpp's 2, n/2, n-3)")
    h.add_argument("--init", choices=["target", "random"], default="target",
                   help="target: LM-head rows of the draft vocabulary and the output norm from the target's "
                        "weights (the decoder layer random); random: all random (default: target)")
    h.add_argument("--weight-type", choices=["q8_0", "f16", "f32"], default="q8_0",
                   help="the GGUF's matrices: q8_0 (a head step reads half the bytes of f16; fc stays f16), f16 "
                        "or f32 (default: q8_0)")
    h.add_argument("--epochs", type=float, default=8.0, help="passes over the data at most (default 8)")
    h.add_argument("--minutes", type=float, default=None, help="training time budget (default: none)")
    h.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    h.add_argument("--lm-head-lr-scale", type=float, default=0.1,
                   help="the LM head's learning rate as a share of --lr: it starts as the target's own rows, "
                        "which a full-rate Adam would pull apart for tokens the answers rarely use (default 0.1)")
    h.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    h.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (default 4096)")
    h.add_argument("--ttt-steps", type=int, default=3, help="rollout steps trained (default 3)")
    h.add_argument("--eval-every", type=int, default=25, help="steps between validation points (default 25)")
    h.add_argument("--val-fraction", type=float, default=0.05, help="answers held out for validation "
                                                                    "(default 0.05)")
    h.add_argument("--labels", choices=["soft", "top"], default="soft",
                   help="soft: learn the target's distribution over its --soft-labels likeliest tokens where the "
                        "data holds them, else its top token; top: its top token only (default soft)")
    h.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints "
                                                                          "(default 120)")
    return p


def config_from_args(args):
    """TrainConfig from the flags; ValueError in the flags' words."""
    from pydantic import ValidationError

    from specray.train.config import TrainConfig

    prompts = args.prompts
    if prompts is None:
        from specray.bench.prompts import default_prompts_path

        prompts = default_prompts_path()
    raw = {
        "target": args.target, "prompts": prompts, "categories": args.categories,
        "exclude_categories": args.exclude_categories, "skip_first": args.skip_first, "limit": args.limit,
        "out": args.out,
        "work_dir": args.work_dir or args.out + ".work", "curve_png": args.curve, "seed": args.seed,
        "weight_type": args.weight_type,
        "threads": args.threads,
        "shape": {"draft_vocab": args.draft_vocab, "target_layers": args.target_layers},
        "gen": {"max_tokens": args.max_tokens, "sampled": args.sampled, "temperature": args.temperature,
                "slots": args.gen_slots, "self_prompts": args.self_prompts, "minutes": args.gen_minutes,
                "max_len": args.max_len, "learn_prompts": args.learn_prompts,
                "max_prompt": args.max_prompt_tokens or None, "soft_labels": args.soft_labels, "text": args.text,
                "rows_minutes": args.rows_minutes},
        "optim": {"epochs": args.epochs, "minutes": args.minutes, "lr": args.lr, "warmup": args.warmup,
                  "lm_head_lr_scale": args.lm_head_lr_scale,
                  "batch_tokens": args.batch_tokens, "ttt_steps": args.ttt_steps, "init": args.init,
                  "eval_every": args.eval_every, "val_fraction": args.val_fraction,
                  "checkpoint_every": args.checkpoint_every, "threads": args.torch_threads,
                  "labels": args.labels},
    }
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"])
            flag = FLAGS.get(field)
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{flag} {err['input']!r}: {msg}" if flag else msg)
        raise ValueError("; ".join(msgs)) from None


def cmd_train_head(args) -> int:
    cfg = config_from_args(args)
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # (torch is imported by specray.train only)
        raise RuntimeError("train-head needs torch: pip install -e \".[train]\"")
    from specray.train.run import train_head

    summary = train_head(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"head: {summary['out']} ({summary['steps']} steps, {summary['train_minutes']:.1f} min training; kept "
          f"step {summary['kept_step']}: validation acceptance length estimate {summary['val_accept_len'] or 0:.2f})")
    return 0
