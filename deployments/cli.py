"""The `specray` command: generate, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_BENCH_CONFIGS = ["none", "ngram_simple", "ngram_mod", "suffix", "ngram_mod,suffix"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and context")
    g.add_argument("--model", default="smollm2-135m",
                   help="packaged alias (smollm2-135m, gemma3-270m) or a .gguf path (default: %(default)s)")
    g.add_argument("--chat-template", default=None,
                   help="chat template name (e.g. gemma, chatml) for models whose GGUF has none")
    g.add_argument("--threads", type=int, default=2, help="CPU threads for the target (default: %(default)s)")
    g.add_argument("--n-ctx", type=int, default=4096, help="context cells shared by all slots (default: %(default)s)")
    g.add_argument("--exact", action="store_true",
                   help="batch-invariant target (llamafile sgemm, tiled K-quant kernels, weight repacking and "
                        "flash attention off; one KV stream per slot): greedy output token-identical to plain "
                        "decoding, at some speed cost")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--policy", choices=["first", "expected", "cost"], default="cost",
                   help="how a chain picks one draft per sequence (default: %(default)s)")
    g.add_argument("--n-max", type=int, default=16, help="max draft tokens per sequence per round (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specray",
        description="Speculative-decoding LLM server and tools (llama.cpp target, Ray Serve deployment).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed, with speculation stats",
                         description="Generate for one prompt in-process and print per-request speculation stats.")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is (default: as a chat user message)")
    gen.add_argument("--spec", default="ngram_mod,suffix",
                     help="speculator chain, names joined by commas, or 'none' (default: %(default)s)")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repeat-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_model_args(gen)
    _add_spec_args(gen)

    bench = sub.add_parser(
        "bench", help="compare speculator chains against no speculation in one run",
        description="Runs every configuration on the same prompts in one process (configurations interleaved "
                    "per category), prints tokens/s, mean acceptance length, acceptance rate and speedup vs "
                    "'none' per category, and checks greedy losslessness against 'none'.")
    bench.add_argument("--prompts", default=None,
                       help="JSONL: one object per line with 'prompt' (raw text) or 'messages' (chat), optional "
                            "'category' (default: Spec-Bench questions from ../shared/data/spec_bench)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to run (default: all)")
    bench.add_argument("--per-category", type=int, default=3, help="prompts per category (default: %(default)s)")
    bench.add_argument("--configs", nargs="+", default=DEFAULT_BENCH_CONFIGS,
                       help="chains to compare, e.g. none ngram_mod ngram_mod,suffix ('none' is always included)")
    bench.add_argument("--max-tokens", type=int, default=192, help="tokens per prompt (default: %(default)s)")
    bench.add_argument("--slots", type=int, default=1, help="concurrent sequences (default: %(default)s)")
    bench.add_argument("--json", default=None, help="write the results as JSON to this path")
    bench.add_argument("--no-llama-baseline", action="store_true",
                       help="skip the plain llama_cpp.Llama generate reference row")
    _add_model_args(bench)
    _add_spec_args(bench)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible server on Ray Serve",
                           description="Start local Ray and the specray app (OpenAI-compatible HTTP).")
    serve.add_argument("--config", default=None, help="YAML config file (flags override it)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    serve.add_argument("--spec", default=None, help="default speculator chain (default: ngram_mod,suffix)")
    serve.add_argument("--slots", type=int, default=None, help="concurrent sequences per replica")
    serve.add_argument("--mode", choices=["colocated", "distributed"], default=None,
                       help="target in the router process, or in its own actor")
    _add_model_args(serve)
    return parser


def _cmd_generate(args) -> int:
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import ChainConfig, EngineConfig, parse_chain
    from specray.engine.sampling import SamplingParams

    chain = ChainConfig(speculators=parse_chain(args.spec), policy=args.policy, n_max=args.n_max)
    cfg = EngineConfig(model=args.model, chat_template=args.chat_template, slots=1, threads=args.threads,
                       n_ctx=args.n_ctx, exact=args.exact, chain=chain)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, seed=args.seed)
    engine = LocalEngine(cfg)
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    req = engine.request(None if messages else args.prompt, messages, max_tokens=args.max_tokens,
                         sampling=sampling, stop=args.stop)
    seq = engine.submit(req)
    import time

    t0 = time.perf_counter()
    while not seq.finished:
        for ev in engine.step():
            if ev.seq is seq and ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    stats = {"prompt_tokens": len(req.prompt_tokens), "completion_tokens": len(seq.generated),
             "finish_reason": seq.finish_reason, "seconds": round(dt, 3),
             "tokens_per_s": round(len(seq.generated) / dt, 1) if dt else None,
             "rounds": seq.rounds, "speculative": seq.spec_summary()}
    print(json.dumps(stats, indent=2), file=sys.stderr)
    return 0


def _cmd_bench(args) -> int:
    from specray.deployments.bench import main_bench

    return main_bench(args)


def _cmd_serve(args) -> int:
    from specray.deployments.serve_cli import main_serve

    return main_serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    for flag in ("max_tokens", "threads", "n_ctx", "per_category", "slots"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if getattr(args, "n_max", None) is not None and args.n_max < 0:
        parser.error(f"--n-max must be >= 0, got {args.n_max}")
    if getattr(args, "temperature", None) is not None and args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "serve":
            return _cmd_serve(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specray {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
