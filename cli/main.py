"""The `specray` command: generate, bench, serve, ab-report, train-head."""

from __future__ import annotations

import argparse
import json
import re
import sys

from specray.bench.order import ORDERS
from specray.engine.config import CacheType, ChainConfig, EngineConfig
from specray.engine.speculators.registry import cli_options, flag_values, model_speculators

# the default chain last: the bench answers "is the default worth it here" without flags
DEFAULT_BENCH_CONFIGS = ["none", "ngram_simple", "ngram_mod", "ngram_cache", "suffix", "ngram_mod,suffix",
                         ChainConfig().label]
FLASH_ATTN_HELP = ("flash attention in the target context: on unless --exact (which needs it off), as llama-server's "
                   "--flash-attn auto on a CPU; --no-flash-attn turns it off. It makes plain decoding faster, most "
                   "with several slots (without it every row attends to every slot's KV cells), and long verify "
                   "batches of one sequence slower")

BUCKETS_HELP = ("with bucketed verifies: rows per decoding sequence a decode-only round may take (1 = a plain "
                "decode); without 1 every round is padded to at least the smallest, so plain rounds and drafts up "
                "to it share one shape (e.g. 4: drafts of at most 3, one shape at a fixed slot count)")
def _shares(text: str) -> tuple[float, ...]:
    """--tensor-split 3,1 -> (3.0, 1.0)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 3,1, got {text!r}") from None


def _add_gpu_split_args(g, default=None) -> None:
    """--main-gpu / --split-mode / --tensor-split (`default=argparse.SUPPRESS` for serve)."""
    g.add_argument("--main-gpu", type=int, default=default if default is not None else 0, metavar="I",
                   help="GPU holding the model with --split-mode none (default: 0)")
    g.add_argument("--split-mode", choices=["none", "layer", "row", "tensor"],
                   default=default if default is not None else "layer",
                   help="how the target spreads over several GPUs (llama.cpp's split_mode; default: layer)")
    g.add_argument("--tensor-split", type=_shares, default=default, metavar="SHARES",
                   help="share of the model per GPU, e.g. 3,1 (default: by free memory)")


ROLLBACK_HELP = ("recurrent and hybrid targets (Mamba, RWKV, LFM2, Qwen3-Next, ...): how a rejected draft is taken "
                 "back out of the state. snapshots: llama.cpp keeps the state after each of the last "
                 "--rollback-snapshots tokens (some architectures only, at most 2 slots; drafts capped at that many); "
                 "checkpoint: "
                 "save before the verify, restore and replay the accepted tokens after a partial rejection; auto: "
                 "checkpoint; off: no drafts on such targets. "
                 "Attention-only targets ignore it")
ROLLBACK_SNAPSHOTS_HELP = "with --rollback snapshots: recurrent states kept per sequence = the most draft tokens"
GPU_LAYERS_HELP = ("target layers offloaded to a GPU; companion models follow, all or none (docs/gpus.md; default: "
                   "all of them where llama.cpp offloads to a GPU it sees, i.e. a CUDA build with a device; 0 "
                   "elsewhere)")


#: the draft's load options: flag, type, metavar, help (dest: the DraftModelConfig field with a draft_ prefix)
DRAFT_OPTION_FLAGS = [
    ("--draft-n-ctx", int, "N", "draft context cells shared by all slots (llama.cpp's -cd; default: the target's "
                                "--n-ctx, x1.5 with --cross-vocab, + 16 per slot)"),
    ("--draft-threads", int, "N", "CPU threads of the draft context (-td; default: the target's --threads)"),
    ("--draft-threads-batch", int, "N", "CPU threads of the draft context for multi-token batches (-tbd; default: "
                                        "--draft-threads)"),
    ("--draft-n-batch", int, "N", "most tokens in one draft decode (default: the target's n_batch)"),
    ("--draft-n-ubatch", int, "N", "physical batch of the draft context, at most --draft-n-batch (default: "
                                   "--draft-n-batch)"),
    ("--draft-n-gpu-layers", int, "N", "draft layers offloaded to a GPU (-ngld; default: all where llama.cpp "
                                       "offloads to a GPU it sees, 0 elsewhere)"),
    ("--draft-main-gpu", int, "I", "the one GPU holding the whole draft model (-devd with one device; default: "
                                   "the target's --main-gpu and split)"),
    ("--draft-cache-type-k", CacheType, "TYPE", "K cache data type of the draft context (-ctkd; default: f16)"),
    ("--draft-cache-type-v", CacheType, "TYPE", "V cache data type of the draft context; a quantised one turns "
                                                  "flash attention on for the draft context (-ctvd; default: f16)"),
]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and context")
    g.add_argument("--model", default="smollm2-135m",
                   help="packaged alias (smollm2-135m, gemma3-270m) or a .gguf path (default: %(default)s)")
    g.add_argument("--chat-template", default=None,
                   help="chat template name (e.g. gemma, chatml) for models whose GGUF has none")
    g.add_argument("--threads", type=int, default=2, help="CPU threads for the target (default: %(default)s)")
    g.add_argument("--n-gpu-layers", type=int, default=None, metavar="N", help=GPU_LAYERS_HELP)
    _add_gpu_split_args(g)
    g.add_argument("--n-ctx", type=int, default=4096,
                   help="context cells, shared by all slots; with --exact split evenly, one share per slot "
                        "(default: %(default)s)")
    g.add_argument("--exact", action="store_true",
                   help="batch-invariant target (llamafile sgemm, tiled K-quant kernels, weight repacking and "
                        "flash attention off; one KV stream per slot): greedy output token-identical to plain "
                        "decoding, at some speed cost")
    g.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=None,
                   help=FLASH_ATTN_HELP + " (default: on unless --exact)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--policy", choices=["first", "expected", "cost"], default="cost",
                   help="how a chain picks one draft per sequence (default: %(default)s)")
    g.add_argument("--n-max", type=int, default=ChainConfig.model_fields["n_max"].default,
                   help="max draft tokens per sequence per round; the cost policy cuts each draft to what pays "
                        "(default: %(default)s)")
    g.add_argument("--rollback", choices=["auto", "snapshots", "checkpoint", "off"], default="auto",
                   help=ROLLBACK_HELP + " (default: %(default)s)")
    g.add_argument("--rollback-snapshots", type=int, default=EngineConfig.model_fields["rollback_snapshots"].default,
                   metavar="N", help=ROLLBACK_SNAPSHOTS_HELP + " (default: %(default)s)")


def _add_draft_args(p: argparse.ArgumentParser, default=None) -> None:
    """--draft-model / --cross-vocab and the draft's load options (`default=argparse.SUPPRESS` for serve: absent
    unless given). The options are named as llama.cpp's draft flags with the --draft- prefix of --draft-model;
    each one unset follows the target (EngineConfig.draft_settings)."""
    g = p.add_argument_group("draft model (the `draft` speculator)")
    for option in cli_options(hidden_rows=False):
        _add_speculator_option(g, option, default)
    g.add_argument("--cross-vocab", default=default if default is not None else False,
                   action="store_true",
                   help="allow a draft model whose vocabulary differs from the target's (drafts go through "
                        "text); without it such a pair is refused, naming the mismatch")
    cache_types = list(CacheType.__args__)
    for flag, kind, metavar, what in DRAFT_OPTION_FLAGS:
        extra = {"choices": cache_types} if kind is CacheType else {"type": kind, "metavar": metavar}
        g.add_argument(flag, default=default, help=what, **extra)
    g.add_argument("--draft-flash-attn", action=argparse.BooleanOptionalAction, default=default,
                   help="flash attention in the draft context (default: the target's --flash-attn; on with a "
                        "quantised --draft-cache-type-v, which --no-draft-flash-attn refuses)")


def _add_speculator_option(g, option, default) -> None:
    """A model speculator's option as its registry entry declares it (`default`: None, or argparse.SUPPRESS)."""
    if option.switch:
        g.add_argument(option.flag, default=default if default is not None else False, action="store_true",
                       help=option.help)
    else:
        g.add_argument(option.flag, default=default, metavar=option.metavar, help=option.help)


def _add_hidden_args(p: argparse.ArgumentParser, default=None, transport: bool = False) -> None:
    """The hidden-state speculators' options (--mtp / --eagle3-model / --dflash-model, from the registry;
    / --hidden-transport) (`default=argparse.SUPPRESS` for serve)."""
    names = ", ".join(f"`{s.name}`" for s in model_speculators(hidden_rows=True))
    g = p.add_argument_group(f"hidden-state speculators ({names})")
    for option in cli_options(hidden_rows=True):
        _add_speculator_option(g, option, default)
    if transport:
        g.add_argument("--hidden-transport", choices=["object_store", "inline", "cuda_ipc"], default=default,
                       help="--mode distributed: how hidden rows go from the target actor to the companion; "
                            "cuda_ipc needs GPUs on one node and falls back to the object store, saying why, "
                            "without them (default: object_store)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specray",
        description="Speculative-decoding LLM server and tools (llama.cpp target, Ray Serve deployment).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed, with speculation stats",
                         description="Generate for one prompt in-process and print per-request speculation stats.")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, not as a chat user message")
    gen.add_argument("--spec", default=ChainConfig().label,
                     help="speculator chain, names joined by commas, or 'none' (default: %(default)s)")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling: keep the smallest set of best tokens whose probability sums to at "
                          "least this; 1 = off (default: %(default)s)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens less likely than this times the best token's probability; 0 = off "
                          "(default: %(default)s)")
    gen.add_argument("--repeat-penalty", type=float, default=1.0,
                     help="repetition penalty over the last 64 tokens: their positive logits are divided by it, "
                          "others multiplied; 1 = off (default: %(default)s)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted once from each token seen in the last 64 tokens, in [-2, 2] (default: 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted once per occurrence in the last 64 tokens, in [-2, 2] (default: 0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    out = gen.add_mutually_exclusive_group()
    out.add_argument("--grammar", default=None, metavar="FILE.gbnf",
                     help="the output follows this GBNF grammar (llama.cpp's grammar sampler)")
    out.add_argument("--json-schema", default=None, metavar="FILE.json",
                     help="the output follows this JSON schema (converted to a grammar)")
    out.add_argument("--json", action="store_true", help="the output is one JSON object")
    _add_model_args(gen)
    _add_spec_args(gen)
    _add_draft_args(gen)
    _add_hidden_args(gen)

    bench = sub.add_parser(
        "bench", help="compare speculator chains in-process, or servers over HTTP, in one run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "In-process (default): runs every configuration (--configs) on the same prompts in one\n"
            "process (configurations interleaved per category), prints tokens/s, mean acceptance\n"
            "length, acceptance rate and speedup vs 'none' per category, and checks greedy\n"
            "losslessness against 'none'. Progress (prompt runs done, elapsed, ETA) goes to stderr;\n"
            "--plot FILE.png draws the speedups. Prompts too long for a sequence's share of the\n"
            "context (--n-ctx; with --exact, --n-ctx divided by --slots) are skipped before the run,\n"
            "named on stderr with the --n-ctx that fits them all, and counted in the table and JSON.\n"
            "--profile FILE.txt writes where the measured rounds' time goes (cProfile).\n"
            "  specray bench --configs ngram_mod,suffix --repeats 2 --plot bench.png --json bench.json\n\n"
            "Over HTTP (--url or --http): streams the prompts to specray servers with each --streams\n"
            "count of concurrent clients (default 1 and 8), and runs the in-process engine on the same\n"
            "prompts in the same run. One table, mode x streams: aggregate tokens/s (completion tokens\n"
            "/ wall time), ratio vs co-located and vs in-process, actor hop ms p50/p95 per round\n"
            "(distributed), rounds, mean sequences per target decode. --json writes it.\n"
            "  specray bench --http --num-prompts 8 --max-tokens 64         # local Ray, both modes\n"
            "  specray bench --url http://127.0.0.1:8000 --url http://10.0.0.2:8000\n"
            "Any OpenAI-compatible server (llama-server too) can be a --url: without /v1/stats its rows\n"
            "have no server-side columns.\n\n"
            "Multi-turn chat (--url with --turns N): conversations of N turns, each turn the whole history\n"
            "plus a new user message (Spec-Bench's MT-bench questions, chained), every turn sent with\n"
            "cache_prompt true and false; per turn: prompt tokens, time to first token with and without\n"
            "the prompt cache, their ratio and the cached tokens the server reports.\n"
            "  specray bench --url http://127.0.0.1:8000 --turns 6 --max-tokens 128 --json mt.json\n\n"
            "Agents (--url with --agents [N]): N conversations share one long system prompt (a tool\n"
            "catalogue with rules), --turns turns each, --concurrency at a time, each turn the history\n"
            "plus a new user message; per server: time to first token p50/p90 of first and later turns,\n"
            "wall time, output tokens/s and the cached prompt tokens the server reports.\n"
            "  specray bench --url http://127.0.0.1:8000 --url http://127.0.0.1:8090 --agents 8 --turns 3 \\\n"
            "      --concurrency 4 --system-tokens 1600 --max-tokens 48 --json agents.json"))
    bench.add_argument("--prompts", default=None,
                       help="JSONL: one object per line with 'prompt' (raw text) or 'messages' (chat), optional "
                            "'category' (default: $SPECRAY_SPEC_BENCH, else Spec-Bench's 480 questions shipped "
                            "in the package, bench/data/spec_bench.jsonl)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to run (default: all)")
    bench.add_argument("--per-category", type=int, default=3, help="prompts per category (default: %(default)s)")
    bench.add_argument("--configs", nargs="+", default=None,
                       help="in-process: chains to compare, e.g. none ngram_mod ngram_mod,suffix ('none' is always "
                            "included); not with --url/--http, which take --spec "
                            f"(default: {' '.join(DEFAULT_BENCH_CONFIGS)})")
    bench.add_argument("--spec-param", action="append", default=None, metavar="SPECULATOR.KEY=VALUE",
                       help="in-process: a speculator parameter every configuration starts from, repeatable (e.g. "
                            "--spec-param suffix.p_min=0.2). A configuration can carry its own: "
                            "CHAIN/SPECULATOR.KEY=VALUE; CHAIN+tune tunes them online (ChainConfig.tune); CHAIN+trees sends draft trees "
                            "(ChainConfig.trees), CHAIN+linear does not; CHAIN@overlap runs overlapped rounds "
                            "(engine.overlap: the last round's text and events made while the target decodes)")
    bench.add_argument("--tune-sweep", action="store_true",
                       help="in-process: run each chain of --configs as configured, tuned online (CHAIN+tune), and at "
                            "every point of its speculators' tuning grids (one speculator at a time), so the tuned "
                            "run is measured against the best fixed setting in the same run")
    bench.add_argument("--max-tokens", type=int, default=192, help="tokens per prompt (default: %(default)s)")
    bench.add_argument("--slots", type=int, default=None,
                       help="concurrent sequences (default: 1 in-process; with --http the largest --streams; with "
                            "--url the first server's slots, for the in-process row)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="in-process: run everything this many times, each pass with fresh speculators and the "
                            "configurations in the opposite order of the pass before; figures sum the passes and "
                            "a `range` column shows each pass's speedup, i.e. how much is noise (default: "
                            "%(default)s)")
    bench.add_argument("--order", choices=ORDERS, default=None,
                       help="in-process: how configurations share the machine. lockstep: each on its own context "
                            "(one model), all advanced one round at a time in turn, so they see the same machine "
                            "speed (on a shared machine the speed of identical runs drifts over time). "
                            "sandwich: one after another, `none` before and after each, each measured against its "
                            "two neighbouring `none` runs; about twice as long. alternate: one after another, the "
                            "order reversed every group (default: lockstep)")
    bench.add_argument("--verify-shape", choices=["exact", "bucketed", "both"], default="exact",
                       help="in-process: bucketed runs every chain with shape-stable verifies (verify rows padded "
                            "to a few batch shapes, for GPU graph replay), both runs each chain both ways "
                            "(CHAIN and CHAIN@bucketed) to measure what padding costs here; a --configs name "
                            "ending in @bucketed asks for it per chain (default: %(default)s)")
    bench.add_argument("--verify-buckets", type=int, nargs="+", default=None, metavar="ROWS",
                       help=BUCKETS_HELP + " (default: the engine's, 1 2 4 8 16)")
    bench.add_argument("--json", default=None, help="write the results as JSON to this path")
    bench.add_argument("--plot", default=None, metavar="PNG",
                       help="in-process: draw the speedup over 'none' by category and configuration to this image "
                            "file, with whiskers from the slowest to the fastest --repeats pass")
    bench.add_argument("--profile", default=None, metavar="PATH",
                       help="in-process: profile the measured rounds with cProfile (per configuration, not model "
                            "loading or calibration) and write a text summary to PATH: rounds, seconds, llama_decode "
                            "vs host milliseconds per round, and the top 30 functions by own and by cumulative time "
                            "(drafting, verification, bookkeeping). With --host-replay: the replayed rounds, the "
                            "replayed decode in place of llama_decode. The profiler slows Python code down: use such "
                            "a run to see where a round's time goes, not for its tok/s")
    bench.add_argument("--host-replay", default=None, metavar="TABLE",
                       help="in-process, instead of the timed run: the round's host cost against a target as fast as "
                            "TABLE, h100 (SmolLM2's step times on an H100, bench/host_replay.py), measured (this "
                            "CPU's calibrated decode) or ROWS:MS,... One real plain pass records each prompt's greedy "
                            "output; then every configuration runs the prompts, queued on --slots, with the decode "
                            "replaced by a busy wait of the table's time that returns the recorded tokens' logits. "
                            "Prints host ms per round by stage, and checks every output equals the recording. On a "
                            "VM a real run's host figures are inflated: caches go cold while the round waits "
                            "(docs/benchmarking.md)")
    bench.add_argument("--no-llama-baseline", action="store_true",
                       help="skip the plain llama_cpp.Llama generate reference row (in-process bench)")
    _add_model_args(bench)
    _add_spec_args(bench)
    _add_draft_args(bench)
    _add_hidden_args(bench)
    h = bench.add_argument_group("over HTTP (Ray Serve)")
    h.add_argument("--url", action="append", default=None, metavar="URL",
                   help="base URL of a running specray server, without /v1 (repeatable; each row is labelled by "
                        "the mode its /v1/stats reports). Nothing else should load it during the run: its "
                        "/v1/stats counters are diffed")
    h.add_argument("--http", action="store_true",
                   help="start a local Ray + Serve, deploy one app per --serve-modes with the model/chain flags "
                        "(routes /bench-colocated, /bench-distributed), bench them, shut everything down")
    h.add_argument("--serve-modes", default=None,
                   help="with --http: comma-separated deployment modes (default: colocated,distributed)")
    h.add_argument("--layouts", default=None,
                   help="with --http: comma-separated serving layouts (fused, split), one app per mode and layout, "
                        "rows labelled MODE/LAYOUT (default: ServeConfig's default layout only)")
    h.add_argument("--target-hops", default=None,
                   help="with --http: comma-separated target hops of the distributed app (auto, actor, compiled), one "
                        "app each, rows labelled distributed / distributed+compiled (default: auto)")
    h.add_argument("--companion-hops", default=None,
                   help="with --http: comma-separated companion hops (auto, actor, compiled), one distributed app "
                        "for each target hop and each of these; a compiled one adds +companion-compiled to the "
                        "row label (default: auto)")
    h.add_argument("--port", type=int, default=None, help="with --http: HTTP port (default: a free one)")
    h.add_argument("--streams", type=int, nargs="+", default=None,
                   help="concurrent client streams, one table row per mode each (default: 1 8)")
    h.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per row, taken round-robin over the categories (default: 16)")
    h.add_argument("--spec", default=None,
                   help="chain: with --http the apps' and in-process engine's chain; with --url sent per request "
                        f"as speculative.chain (default: {ChainConfig().label} with --http; the server's own chain "
                        "with --url)")
    h.add_argument("--no-in-process", action="store_true",
                   help="skip the in-process engine row (it loads the model in this process)")
    h.add_argument("--api-key", default=None,
                   help="bearer token for servers that require one (default: $SPECRAY_API_KEY)")
    h.add_argument("--timeout", type=float, default=600, help="seconds per HTTP request (default: %(default)s)")
    mt = bench.add_argument_group("multi-turn chat over HTTP (with --url)")
    mt.add_argument("--turns", type=int, default=None, metavar="N",
                    help="run the multi-turn bench instead: conversations of N turns (history grows every turn), "
                         "each turn with cache_prompt true and false; prints TTFT per turn with and without the "
                         "prompt cache. --prompts must have entries with 2+ 'turns', as Spec-Bench's have. With "
                         "--agents: each agent conversation's turns (default: 3)")
    mt.add_argument("--conversations", type=int, default=None, metavar="K",
                    help="with --turns: conversations per server, one after another; the table shows per-turn "
                         "medians (default: 3)")
    ag = bench.add_argument_group("agents over HTTP (with --url)")
    ag.add_argument("--agents", type=int, nargs="?", const=8, default=None, metavar="N",
                    help="run the agent bench instead: N conversations (default 8) that share one system prompt, "
                         "--turns turns each, every turn the whole history and the server's own answers plus a "
                         "new user message (Spec-Bench's MT-bench questions), streamed, greedy, --max-tokens per "
                         "answer. Per server: TTFT p50/p90 of first and of later turns, wall time, output tok/s, "
                         "cached prompt tokens (median, share of prompt tokens), requests, errors. Several --url "
                         "run one after another, each after an unmeasured warm-up request")
    ag.add_argument("--concurrency", type=int, default=None, metavar="C",
                    help="with --agents: conversations at a time, each its turns in order; with --models: client "
                         "threads per model (default: 4)")
    ag.add_argument("--system-tokens", type=int, default=None, metavar="S",
                    help="with --agents: approximate size in tokens of the shared system prompt, a deterministic "
                         "tool catalogue (JSON tool definitions and numbered rules) (default: 1600)")

    mm = bench.add_argument_group("several models over HTTP (with --url)")
    mm.add_argument("--models", nargs="+", action="append", default=None, metavar="ID[@URL]",
                    help="run the multi-model bench instead: every listed model gets --concurrency clients of its "
                         "own (default 4), all at once, each request naming its model (ID@URL: that model's own "
                         "server; ID: the first --url). Repeat --models to compare setups, e.g. one two-model app "
                         "against two one-model apps; they run in turn, --repeats times in alternating order. "
                         "Per model: requests, errors, tok/s, mean TTFT, acceptance length; and each setup's tok/s "
                         "per model over the first setup's. --num-prompts prompts per model (default: 4 per "
                         "client)")
    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible server on Ray Serve",
        description="Start the specray app (OpenAI-compatible HTTP) on Ray Serve, in a running Ray cluster or a "
                    "local Ray it starts. Settings come from "
                    "ServeConfig's defaults, then --config FILE, then every flag given on the command line "
                    "(a flag always wins over the file, even when it repeats the default; a flag not given "
                    "never overrides the file).")
    _add_serve_args(serve)  # the draft-model and hidden-state groups too, after speculation

    ab = sub.add_parser(
        "ab-report", help="compare the A/B arms of a server (or a saved /v1/stats) with confidence intervals",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Reads the per-arm request records of GET /v1/stats and prints per arm: requests, tokens/s per\n"
            "request (decode speed after the first token), mean acceptance length, acceptance rate, TTFT and\n"
            "ITL percentiles, each with a 95% bootstrap interval, and the speedup over the baseline arm (the\n"
            "`none` arm, else the first). A winner is named only when its tokens/s interval lies above every\n"
            "other arm's.\n"
            "  specray ab-report --url http://127.0.0.1:8000 --plot ab.png --save-stats run.json\n"
            "  specray ab-report --from run.json\n"
            "  specray ab-report --url http://127.0.0.1:8000 --model gemma   # one model of a multi-model app"))
    src = ab.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", default=None, help="base URL of a running specray server (without /v1)")
    src.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                     help="a saved /v1/stats JSON (e.g. written by --save-stats)")
    ab.add_argument("--model", default=None, metavar="ID",
                    help="with several models: compare this model's arms (id or alias), including the requests "
                         "its split diverted to another model (arm @OTHER); default: the default model's")
    ab.add_argument("--plot", default=None, metavar="PNG", help="draw the comparison to this image file")
    ab.add_argument("--json", default=None, metavar="FILE", help="write the report (estimates, intervals) as JSON")
    ab.add_argument("--save-stats", default=None, metavar="FILE",
                    help="with --url: also save the raw /v1/stats answer, to re-run the report later with --from")
    ab.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default: %(default)s)")
    ab.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    ab.add_argument("--api-key", default=None, help="bearer token (default: $SPECRAY_API_KEY)")

    from .synth import add_parsers as add_synth_parsers
    from .train_head import add_parser as add_train_head_parser

    add_train_head_parser(sub)
    add_synth_parsers(sub)
    return parser


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """`specray serve` flags, grouped by topic: default SUPPRESS (absent unless given), so config_from_args can
    tell a flag from the file; the help shows ServeConfig's real defaults."""
    from specray.deployments.config import ServeConfig
    from specray.engine.config import ChainConfig, EngineConfig

    S = argparse.SUPPRESS

    def d(model, name: str) -> str:
        f = model.model_fields[name]
        v = f.default_factory() if f.default_factory is not None else f.default
        if isinstance(v, bool):
            v = "on" if v else "off"
        elif isinstance(v, (list, tuple)):
            v = " ".join(map(str, v))
        return f"(default: {v})"

    p.add_argument("--config", default=None, help="YAML file of ServeConfig fields (flags override it; "
                                                  "docs/configuration.md lists the fields)")

    g = p.add_argument_group("model and context")
    g.add_argument("--model", action="append", default=S, metavar="[ID=]MODEL",
                   help="packaged alias (smollm2-135m, gemma3-270m) or a .gguf path "
                        f"{d(EngineConfig, 'model')}. Repeat it to serve several models in one app, routed by "
                        "each request's `model` field: --model smol=smollm2-135m --model gemma=gemma3-270m (ID: "
                        "the id requests name; default: the alias or the file's stem). The other flags apply to "
                        "every model; per-model settings (aliases, chain, placement, scaling) go in --config's "
                        "`models` (docs/serving.md)")
    g.add_argument("--default-model", default=S, metavar="ID",
                   help="with several models: the one that answers a request without `model` (default: the first)")
    g.add_argument("--chat-template", default=S,
                   help="chat template name (e.g. gemma, chatml) for models whose GGUF has none (default: the "
                        "GGUF's own)")
    g.add_argument("--threads", type=int, default=S,
                   help="CPU threads for the target; set it so that several replicas on one node add up to the "
                        "cores (default: the CPUs the target's process may use)")
    g.add_argument("--n-ctx", type=int, default=S, help=f"context cells shared by all slots {d(EngineConfig, 'n_ctx')}")
    g.add_argument("--exact", action=argparse.BooleanOptionalAction, default=S,
                   help="batch-invariant target (greedy output token-identical to plain decoding, at some speed "
                        f"cost); --no-exact turns off a file's exact: true (docs/serving.md; "
                        f"default: {'on' if EngineConfig().exact else 'off'})")
    g.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=S,
                   help=f"{FLASH_ATTN_HELP} (docs/serving.md; default: on unless --exact)")
    g.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=S,
                   help="keep finished requests' KV in their slots and reuse the longest common prefix for new "
                        "prompts (the next turn of a chat prefills only the new message); requests opt out with "
                        "`cache_prompt: false`. Usage reports prompt_tokens_details.cached_tokens "
                        f"(docs/serving.md; default: {'on' if EngineConfig().prompt_cache else 'off'})")
    g.add_argument("--cache-ram", type=int, default=S, metavar="MIB",
                   help="host memory for the prompt cache's host tier, as llama-server's --cache-ram: prefixes "
                        "evicted from the KV cells are saved there and restored for a later prompt that shares "
                        "them (an agent's next turn, a shared system prompt); 0 turns it off; /v1/stats "
                        "prompt_cache.host shows entries and bytes (default: a quarter of the memory free at "
                        "start, at most 8192)")
    g.add_argument("--prefill-budget", type=int, default=S, metavar="TOKENS",
                   help="prompt tokens one round carries in all while other requests generate, so their streams "
                        "keep their pace during long prefills; short prompts and continuations go first "
                        "(default: as many as a round's batch, n_batch, has room for)")
    g.add_argument("--queue-order", choices=["cached", "arrival"], default=S,
                   help="when more requests wait than slots are free, which gets the next slot: cached, the one "
                        "with the fewest prompt tokens left after its longest cached prefix (an agent's next turn "
                        "before a new conversation), bounded by --queue-max-wait; arrival, first come first served "
                        f"{d(EngineConfig, 'queue_order')}")
    g.add_argument("--queue-max-wait", type=float, default=S, metavar="SECONDS",
                   help="with --queue-order cached, a request that has waited this long goes ahead of any that "
                        f"has not {d(EngineConfig, 'queue_max_wait_s')}")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=S,
                   help="overlapped rounds: the last round's text and events are made and delivered, "
                        "model-free speculators set up new sequences and merge finished ones, and the policy "
                        "learns from the last round's verdicts, while the "
                        "target decodes (on a GPU, behind the device's work; on CPU on a helper thread, which "
                        "gains little: the decode's threads hold the cores; with a target actor, while it decodes) "
                        f"(default: {'on' if EngineConfig().overlap else 'off'})")
    g.add_argument("--tile-pads", action=argparse.BooleanOptionalAction, default=S,
                   help="pad a round of fewer rows than the CPU flash-attention kernel's tile (64) up to it where "
                        "the cost model prices that cheaper: at long contexts the tiled kernel is several times "
                        "cheaper per row, so an agent's next turn answers sooner; the pad rows' output and cells "
                        f"are dropped (default: {'on' if EngineConfig().tile_pads else 'off'})")
    g.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=S,
                   help="a generation that reaches its context discards old tokens and goes on (llama-server's "
                        "--context-shift; requests may set context_shift, n_keep, n_discard themselves) "
                        f"{d(EngineConfig, 'context_shift')}")

    g = p.add_argument_group("speculation")
    g.add_argument("--spec", default=S,
                   help="default speculator chain (docs/speculators.md): names joined by commas, or 'none'; a "
                        f"file's per-speculator params are kept (default: {ChainConfig().label})")
    g.add_argument("--policy", choices=["first", "expected", "cost"], default=S,
                   help=f"how a chain picks one draft per sequence {d(ChainConfig, 'policy')}")
    g.add_argument("--n-max", type=int, default=S,
                   help=f"max draft tokens per sequence per round {d(ChainConfig, 'n_max')}")
    g.add_argument("--spec-tune", action=argparse.BooleanOptionalAction, default=S,
                   help="tune each n-gram speculator's look-up parameters online (a bandit per speculator and "
                        "request class, `speculative.tune_class`, judging every setting side by side on shadow "
                        "look-ups that are never sent; /v1/stats `tuning` shows the choice) "
                        f"{d(ChainConfig, 'tune')}")
    g.add_argument("--spec-trees", action=argparse.BooleanOptionalAction, default=S,
                   help="send draft trees where they pay: the main draft plus the runner-ups its speculator holds "
                        "(suffix, ngram_map_k4v, ngram_cache, draft), verified in one decode; requests opt out with "
                        f"`speculative.tree: false` (docs/speculators.md) {d(ChainConfig, 'trees')}")
    g.add_argument("--tree-branches", type=int, default=S, metavar="N",
                   help="runner-up branches a draft tree may carry beside its main draft; each needs a sequence "
                        f"id of the target's (slots x (1 + N)); 0: linear drafts {d(EngineConfig, 'tree_branches')}")
    g.add_argument("--rollback", choices=["auto", "snapshots", "checkpoint", "off"], default=S,
                   help=f"{ROLLBACK_HELP} {d(EngineConfig, 'rollback')}")
    g.add_argument("--rollback-snapshots", type=int, default=S, metavar="N",
                   help=f"{ROLLBACK_SNAPSHOTS_HELP} {d(EngineConfig, 'rollback_snapshots')}")
    _add_draft_args(p, S)
    _add_hidden_args(p, S, transport=True)

    g = p.add_argument_group("serving (HTTP, layouts)")
    g.add_argument("--host", default=S, help=f"bind address {d(ServeConfig, 'host')}")
    g.add_argument("--port", type=int, default=S, help=f"HTTP port {d(ServeConfig, 'port')}")
    g.add_argument("--api-key", default=S,
                   help="require `Authorization: Bearer KEY` on every endpoint but /health (default: the file's "
                        "api_key, else $SPECRAY_API_KEY, else none)")
    g.add_argument("--slots", type=int, default=S,
                   help=f"concurrent sequences per replica {d(EngineConfig, 'slots')}")
    g.add_argument("--layout", choices=["fused", "split"], default=S,
                   help="fused: with one arm, the engine replica deployment serves HTTP itself (one process "
                   "fewer per streamed token: replica -> Serve's proxy -> client); split: an Ingress deployment in "
                   "front of the engine deployment (replica -> ingress -> proxy). Several --arm, or autoscaling, "
                   f"always run split (docs/serving.md; default: {ServeConfig().layout})")
    g.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=S,
                   help="the ingress replica (fused: the engine replica) listens on --port itself, no HTTP proxy "
                   "process in between (Ray Serve's direct ingress; Serve's proxy moves to a free port). Needs the "
                   "local Ray specray serve starts (not a joined cluster) and one ingress replica; "
                   "--no-direct-ingress keeps Serve's proxy in front (docs/serving.md; default: on exactly where "
                   "those hold)")
    g.add_argument("--direct-writes", action=argparse.BooleanOptionalAction, default=S,
                   help="fused layout with direct ingress: the round thread writes each plain streamed delta to the "
                   "client's socket itself (plain HTTP/1.1), so no event loop wakes per token; other streams, and "
                   "any stream where a check fails, go through the event loop (docs/serving.md; "
                   f"default: {'on' if ServeConfig().direct_writes else 'off'})")
    g.add_argument("--user-code-loop", choices=["shared", "separate"], default=S,
                   help="where Ray Serve runs the serving replica's async code: shared (Ray's own event loop; one "
                   "thread wake-up per streamed chunk instead of two, less CPU taken from llama.cpp's decode on "
                   "small nodes) or separate, Serve's default: a second event loop thread (docs/serving.md; "
                   f"default: {ServeConfig().user_code_loop})")

    g = p.add_argument_group("Ray and cluster")
    g.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster to join: HOST:PORT, 'auto' (the one `ray start` left on this machine) or "
                   "'local' (always a new one); the first line printed says which (docs/cluster.md; default: "
                   "$RAY_ADDRESS, else the running cluster `ray start` recorded here, else a new local Ray)")
    g.add_argument("--quiet-ray", action=argparse.BooleanOptionalAction, default=True,
                   help="where specray serve starts its own local Ray: slower periodic loops in Ray's own processes "
                   "(Serve's control loop 0.5 s, metrics export and the raylet's reports 1 s, the log monitor's "
                   "folder listing 2 s, the dashboard agent's node report 10 s), so that they take less of the "
                   "idle CPU a small node's decode threads would otherwise lose; a variable already set keeps "
                   "its value (docs/serving.md; default: on)")
    g.add_argument("--mode", choices=["colocated", "distributed"], default=S,
                   help=f"target in the router process, or in its own actor {d(ServeConfig, 'mode')}")
    g.add_argument("--target-hop", choices=["auto", "actor", "compiled"], default=S,
                   help="--mode distributed: each round reaches the target actor by an actor call, or through a Ray "
                   "Compiled Graph (shared-memory channels; they poll, so it pays where a core is left beside the "
                   "target's threads); auto: compiled where the target's node has a spare core or a GPU "
                   f"(docs/serving.md; default: {ServeConfig().target_hop})")
    g.add_argument("--companion-hop", choices=["auto", "actor", "compiled"], default=S,
                   help="--mode distributed: the same for each round's draft call to the companion actor (draft "
                   "model, mtp, eagle3, dflash); auto: compiled where the node has a core beyond the target's and "
                   f"the companion's threads, or the target decodes on a GPU {d(ServeConfig, 'companion_hop')}")

    g = p.add_argument_group("GPU")
    g.add_argument("--n-gpu-layers", type=int, default=S, metavar="N", help=GPU_LAYERS_HELP)
    _add_gpu_split_args(g, default=S)
    g.add_argument("--verify-shape", choices=["exact", "bucketed"], default=S,
                   help="bucketed: pad decode-only rounds' verifies to a few batch shapes (--verify-buckets) so "
                        "a GPU backend can replay its graphs; costs speed on CPU (docs/serving.md; "
                        f"default: {EngineConfig().verify_shape})")
    g.add_argument("--verify-buckets", type=int, nargs="+", default=S, metavar="ROWS",
                   help=BUCKETS_HELP + f" {d(EngineConfig, 'verify_buckets')}")

    g = p.add_argument_group("A/B arms")
    g.add_argument("--arm", action="append", default=S, metavar="NAME=CHAIN[@WEIGHT]",
                   help="an A/B arm, repeatable: its own engine deployment running CHAIN ('none' = no "
                        "speculation), receiving WEIGHT of the traffic (1 if not given), e.g. --arm base=none@1 --arm "
                        "fast=ngram_mod,suffix@1. Requests stick to an arm by their `user` field or X-Session-Id "
                        "header; X-Specray-Arm forces one. An arm the --config file also names keeps its other "
                        "settings (params, autoscaling); given --arm flags replace the file's set of arms "
                        "(docs/ab-testing.md; default: the file's arms, else one arm running --spec)")


def _grammar_arg(args) -> str | None:
    """The GBNF of generate's --grammar / --json-schema / --json (SystemExit naming the flag if it is bad)."""
    from specray.native.grammar import JSON_OBJECT_GBNF, GrammarError, schema_to_gbnf

    flag, path = ("--grammar", args.grammar) if args.grammar else ("--json-schema", args.json_schema)
    if args.json:
        return JSON_OBJECT_GBNF
    if not path:
        return None
    try:
        with open(path) as f:
            text = f.read()
        return text if flag == "--grammar" else schema_to_gbnf(json.loads(text))
    except (OSError, ValueError) as e:  # GrammarError and JSONDecodeError are ValueErrors
        raise SystemExit(f"specray generate: error: {flag} {path}: {e}") from None


def _cmd_generate(args) -> int:
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig, HiddenStateConfig, parse_chain
    from specray.engine.sampling import SamplingParams

    chain = ChainConfig(speculators=parse_chain(args.spec), policy=args.policy, n_max=args.n_max)
    cfg = EngineConfig(model=args.model, chat_template=args.chat_template, slots=1, threads=args.threads,
                       n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu, split_mode=args.split_mode,
                       tensor_split=args.tensor_split, n_ctx=args.n_ctx, exact=args.exact, flash_attn=args.flash_attn,
                       chain=chain, rollback=args.rollback, rollback_snapshots=args.rollback_snapshots,
                       draft=DraftModelConfig.from_flags(args),
                       hidden=HiddenStateConfig(**flag_values(args, "hidden")))
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed, grammar=_grammar_arg(args))
    if cfg.hidden.enabled:  # a bad --eagle3-model / --dflash-model fails before the target loads
        from specray.native.hidden_heads import target_taps

        target_taps(cfg)
    engine = LocalEngine(cfg)
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    req = engine.request(None if messages else args.prompt, messages, max_tokens=args.max_tokens,
                         sampling=sampling, stop=args.stop)
    try:
        seq = engine.submit(req)
    except ValueError as e:  # e.g. a --grammar that does not compile
        engine.close()
        print(f"specray generate: error: {e}", file=sys.stderr)
        return 2
    import time

    t0 = time.perf_counter()
    while not seq.finished:
        for ev in engine.step():
            if ev.seq is seq and ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    if seq.error is not None:
        print(f"specray generate: the request failed: {seq.error}", file=sys.stderr)
        return 1
    stats = {"prompt_tokens": len(req.prompt_tokens), "completion_tokens": len(seq.generated),
             "finish_reason": seq.finish_reason, "seconds": round(dt, 3),
             "tokens_per_s": round(len(seq.generated) / dt, 1) if dt else None,
             "rounds": seq.rounds, "speculative": seq.spec_summary()}
    print(json.dumps(stats, indent=2), file=sys.stderr)
    return 0


def _cmd_bench(args) -> int:
    if args.models is not None:
        return _cmd_bench_models(args)
    if args.agents is not None or args.concurrency is not None or args.system_tokens is not None:
        return _cmd_bench_agents(args)  # (--concurrency is also the multi-model bench's, handled above)
    if args.turns is not None or args.conversations is not None:
        return _cmd_bench_multiturn(args)
    if args.url or args.http:
        if args.url and args.http:
            raise ValueError("--url benches running servers, --http starts its own: give one of them")
        if args.configs is not None:
            raise ValueError("--configs compares chains in-process; the HTTP bench runs one chain: use --spec")
        if args.repeats != 1:
            raise ValueError("--repeats is for the in-process bench; the HTTP bench runs each stream count once")
        if args.order is not None:
            raise ValueError("--order is for the in-process bench; the HTTP bench runs one chain")
        if args.plot is not None:
            raise ValueError("--plot draws the in-process bench's speedups; the HTTP bench has no plot")
        if args.profile is not None:
            raise ValueError("--profile profiles the in-process bench's rounds; not with --url/--http")
        from specray.bench.http_compare import main_http_bench

        return main_http_bench(args)
    http_only = [f for f in ("serve_modes", "layouts", "port", "streams", "num_prompts", "spec", "api_key")
                 if getattr(args, f) is not None] + [f for f in ("no_in_process",) if getattr(args, f)]
    if http_only:
        raise ValueError(f"--{http_only[0].replace('_', '-')} needs --url or --http")
    from specray.bench.run import main_bench

    args.configs = args.configs or list(DEFAULT_BENCH_CONFIGS)
    args.order = args.order or "lockstep"
    args.slots = args.slots or 1
    return main_bench(args)


def _cmd_bench_multiturn(args) -> int:
    if args.turns is None:
        raise ValueError("--conversations is for the multi-turn bench: give --turns N too")
    if not args.url:
        raise ValueError("--turns benches running servers: give --url URL")
    for flag in ("http", "streams", "num_prompts", "configs", "plot", "order", "serve_modes", "port", "profile"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to the multi-turn bench (--turns), "
                             "which sends one request at a time")
    from specray.bench.multiturn import main_multiturn

    return main_multiturn(args)


def _cmd_bench_models(args) -> int:
    if args.agents is not None or args.turns is not None or args.conversations is not None:
        raise ValueError("--models is its own bench: leave out --agents, --turns and --conversations")
    for flag in ("http", "streams", "configs", "plot", "order", "serve_modes", "port", "profile", "spec"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to the multi-model bench (--models)")
    from specray.bench.multi_model import main_multi_model

    return main_multi_model(args)


def _cmd_bench_agents(args) -> int:
    if args.agents is None:
        flag = "--concurrency" if args.concurrency is not None else "--system-tokens"
        raise ValueError(f"{flag} is for the agent bench: give --agents [N] too")
    if not args.url:
        raise ValueError("--agents benches running servers: give --url URL")
    if args.conversations is not None:
        raise ValueError("--conversations is for the multi-turn bench (--turns alone); with --agents give the "
                         "number of conversations as --agents N")
    for flag in ("http", "streams", "num_prompts", "configs", "plot", "order", "serve_modes", "port", "profile"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to the agent bench (--agents)")
    from specray.bench.agents import main_agents

    return main_agents(args)


def _cmd_serve(args) -> int:
    from specray.cli.serve import main_serve

    return main_serve(args)


def flag_message(error, dests: set[str], prefix: str = "") -> str:
    """A config ValidationError in the words of the command line: field names that are flags become flags
    (`prefix`: the flags' own, e.g. "draft_" for DraftModelConfig's fields), and an error of one field starts
    with its flag and the value given.

    >>> from specray.engine.config import EngineConfig
    >>> try:
    ...     EngineConfig(exact=True, flash_attn=True)
    ... except ValueError as e:
    ...     print(flag_message(e, {"exact", "flash_attn"}))
    --flash-attn conflicts with --exact (batch-invariant kernels need flash attention off)
    """
    pattern = r"\b(" + "|".join(sorted(map(re.escape, dests), key=len, reverse=True)) + r")\b"

    def flag(name: str) -> str:
        return "--" + (prefix + name).replace("_", "-")

    msgs = []
    for err in error.errors():
        msg = re.sub(pattern, lambda m: flag(m.group(1)), err["msg"].removeprefix("Value error, "))
        field = ".".join(map(str, err["loc"]))
        msgs.append(f"{flag(field)} {err['input']!r}: {msg}" if field in dests else msg)
    return "; ".join(msgs)


def _check_engine_rules(parser: argparse.ArgumentParser, args) -> None:
    """The engine's rules (exact mode, flash attention, ...) live in EngineConfig's validators; check the flags
    given against them before anything loads, and name the flags in the error."""
    from pydantic import ValidationError

    from specray.engine.config import EngineConfig

    given = {k: getattr(args, k) for k in ("exact", "flash_attn") if isinstance(getattr(args, k, None), bool)}
    try:
        EngineConfig.model_validate(given)
    except ValidationError as e:
        dests = {a.dest for a in parser._actions} | {a.dest for sp in _subparsers(parser) for a in sp._actions}
        parser.error(flag_message(e, dests))


def _check_draft_flags(parser: argparse.ArgumentParser, args) -> None:
    """The draft's --draft-<option> flags against DraftModelConfig (ranges, llama.cpp's rules) before anything
    loads; an error names the flags."""
    from pydantic import ValidationError

    from specray.engine.config import DRAFT_LOAD_FIELDS, DraftModelConfig

    try:
        DraftModelConfig.from_flags(args)
    except ValidationError as e:
        parser.error(flag_message(e, set(DRAFT_LOAD_FIELDS), prefix="draft_"))


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [sp for a in parser._actions if isinstance(a, argparse._SubParsersAction) for sp in a.choices.values()]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    for flag in ("max_tokens", "threads", "n_ctx", "per_category", "slots", "num_prompts", "repeats", "turns",
                 "conversations", "agents", "concurrency", "system_tokens"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("presence_penalty", "frequency_penalty"):
        v = getattr(args, flag, None)
        if v is not None and not -2.0 <= v <= 2.0:
            parser.error(f"--{flag.replace('_', '-')} must be in [-2, 2], got {v}")
    v = getattr(args, "rollback_snapshots", None)
    if v is not None and not 1 <= v <= 64:
        parser.error(f"--rollback-snapshots must be 1-64, got {v}")
    for flag in ("streams", "verify_buckets"):
        if any(c < 1 for c in getattr(args, flag, None) or ()):
            parser.error(f"--{flag.replace('_', '-')} must all be >= 1, got {getattr(args, flag)}")
    for flag in ("n_max", "n_gpu_layers", "main_gpu", "cache_ram"):
        v = getattr(args, flag, None)
        if v is not None and v < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {v}")
    v = getattr(args, "tree_branches", None)
    if v is not None and not 0 <= v <= 15:
        parser.error(f"--tree-branches must be 0 to 15, got {v}")
    v = getattr(args, "queue_max_wait", None)
    if v is not None and not v > 0:
        parser.error(f"--queue-max-wait must be > 0 seconds, got {v}")
    v = getattr(args, "prefill_budget", None)
    if v is not None and v < 16:
        parser.error(f"--prefill-budget must be >= 16 (prompt tokens a round), got {v}")
    _check_engine_rules(parser, args)
    _check_draft_flags(parser, args)
    if getattr(args, "temperature", None) is not None and args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if getattr(args, "host_replay", None) is not None:  # a bad table fails now, not after the model has loaded
        from specray.bench.host_replay import parse_table

        if args.url or args.http:
            parser.error("--host-replay runs in-process: not with --url/--http")
        for flag, unused in (("--plot", args.plot), ("--repeats", args.repeats != 1),
                             ("--tune-sweep", args.tune_sweep)):
            if unused:
                parser.error(f"{flag} is for the timed bench, not with --host-replay (it runs each prompt once)")
        if args.host_replay not in ("h100", "measured"):
            try:
                parse_table(args.host_replay)
            except ValueError as e:
                parser.error(str(e))
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "train-head":
            from .train_head import cmd_train_head

            return cmd_train_head(args)
        if args.command in ("synth-model", "cost-curve"):
            from .synth import cmd_cost_curve, cmd_synth_model

            return (cmd_synth_model if args.command == "synth-model" else cmd_cost_curve)(args)
        if args.command == "ab-report":
            from specray.bench.ab_report import main_ab_report

            if args.bootstrap < 0:
                parser.error(f"--bootstrap must be >= 0, got {args.bootstrap}")
            return main_ab_report(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"specray {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
