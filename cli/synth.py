"""`specray synth-model` (a synthetic llama target of a chosen size) and `specray cost-curve` (its verify cost)."""

from __future__ import annotations

import argparse
import json
import sys
import time

SYNTH_DESCRIPTION = """\
Write a llama-architecture GGUF of about --params weights with a real model's vocabulary, tokenizer and chat
template (--vocab-from, default SmolLM2's) and seeded random weights: a target with realistic step times where
no large model can be had (an offline GPU machine). Its text is meaningless: measure step times and round
overheads on it, never acceptance, and label every figure from it synthetic (specray cost-curve does).

  specray synth-model --params 1.5B --out /tmp/synth-1.5b.gguf      # ~1.6 GB at q8_0
  specray cost-curve --model /tmp/synth-1.5b.gguf                  # cost(k)/cost(1), k = 1..16
  specray bench --model /tmp/synth-1.5b.gguf --configs none ngram_mod  # host time per round on it
"""


def _count(text: str) -> int:
    from specray.native.synthetic_llama import parse_count

    try:
        n = parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 1_000_000 <= n <= 20_000_000_000:
        raise argparse.ArgumentTypeError(f"expected 1M to 20B parameters, got {text!r}")
    return n


def add_parsers(sub) -> None:
    from specray.native.synthetic_llama import TYPES

    p = sub.add_parser("synth-model", help="write a synthetic llama GGUF of a chosen size (random weights)",
                       description=SYNTH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", required=True, type=_count, metavar="N",
                   help="parameter count: 1.5B, 300M, 2e9 (the shape comes close to it: the line printed says "
                        "how close)")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="file to write (replaced if it exists)")
    p.add_argument("--type", dest="wtype", choices=TYPES, default="q8_0",
                   help="weight matrices' type (norms stay f32; default: %(default)s)")
    p.add_argument("--vocab-from", default="smollm2-135m", metavar="MODEL",
                   help="alias or GGUF whose vocabulary, tokenizer and chat template are copied (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights' random seed (default: %(default)s)")
    p.add_argument("--n-ctx-train", type=int, default=8192, help="context length in the GGUF (default: %(default)s)")

    c = sub.add_parser("cost-curve", help="time k-token decodes of a model, k = 1..K: its verify cost curve",
                       description="Time decodes of k = 1..--max-k tokens after a short prefix (each paired with "
                                   "a 1-token decode, median of --reps) and print cost(k)/cost(1). A model "
                                   "written by `specray synth-model` is labelled SYNTHETIC.")
    c.add_argument("--model", required=True, metavar="MODEL", help="alias or GGUF path")
    c.add_argument("--max-k", type=int, default=16, help="largest decode size (default: %(default)s)")
    c.add_argument("--reps", type=int, default=5, help="pairs timed per size (default: %(default)s)")
    c.add_argument("--threads", type=int, default=4, help="llama.cpp threads (default: %(default)s)")
    c.add_argument("--n-gpu-layers", type=int, default=None, metavar="N",
                   help="layers offloaded (default: all where llama.cpp sees a GPU, else 0)")
    c.add_argument("--flash-attn", action="store_true", help="flash attention on")
    c.add_argument("--json", default=None, metavar="FILE", help="also write the curve as JSON")


def cmd_synth_model(args) -> int:
    from specray.native.synthetic_llama import write_synthetic_llama

    t0 = time.perf_counter()
    print(f"specray synth-model: writing about {args.params / 1e9:.2f}B parameters ({args.wtype}) to {args.out}",
          file=sys.stderr)
    s = write_synthetic_llama(args.out, args.params, wtype=args.wtype, vocab_from=args.vocab_from, seed=args.seed,
                              n_ctx_train=args.n_ctx_train,
                              progress=lambda line: print(f"specray synth-model: {line}", file=sys.stderr))
    print(f"{args.out}: SYNTHETIC llama, {s.params:,} parameters ({s.params / args.params - 1:+.2%} of the request), "
          f"n_embd {s.n_embd}, {s.n_layer} layers, {s.n_head} heads ({s.n_head_kv} KV), n_ff {s.n_ff}, "
          f"vocabulary {s.n_vocab}, {args.wtype}, in {time.perf_counter() - t0:.0f} s")
    return 0


def cmd_cost_curve(args) -> int:
    from specray.bench.cost_curve import format_curve, measure_cost_curve

    if not 1 <= args.max_k <= 512 or args.reps < 1:
        raise ValueError(f"--max-k must be 1-512 and --reps >= 1, got {args.max_k} and {args.reps}")
    r = measure_cost_curve(args.model, max_k=args.max_k, reps=args.reps, threads=args.threads,
                           n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn)
    print(format_curve(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
