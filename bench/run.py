"""`specray bench`: speculator chains against no speculation, in one run.

Every configuration runs the same prompts on the same loaded model, category
by category, configurations interleaved so that machine drift hits them all
alike. At temperature 0 each configuration's tokens are compared with
`none`'s: a divergence whose first differing position had a top-2 logit
margin (in the `none` run) below the tie bound counts as `tie_divergence`
(llama.cpp's CPU kernels are not batch-invariant, so near-ties may flip),
anything else as a `mismatch`. With --exact every divergence is a mismatch.

The parts, one file each: prompts.py (the prompt file), report.py (figures,
table, JSON), divergence.py (outputs against `none`'s), probes.py (the tie
bound's drift probes), lockstep.py (running a group of prompts through the
configurations), order.py (run order and baselines), progress.py and plot.py.
This module runs them together; it also re-exports what other code imports
from `specray.bench.run`.
"""

from __future__ import annotations

import os
import platform
import sys
import time

from specray.deployments.local_engine import LocalEngine
from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig, HiddenStateConfig
from specray.engine.cores import cores_in_use
from specray.engine.speculators.registry import flag_values
from specray.native.lib import build_has_amx, verify_cols_enabled

from .divergence import classify_divergence, compare_runs, divergence_margin
from .fit import check_prompts
from .host_replay import parse_table, run_host_replay
from .host_replay import table_text as replay_table_text
from .lockstep import ConfigRun, LlamaRun, PlainLlama, cpu_steal_seconds, run_alone, run_lockstep
from .order import ORDERS, baseline_positions, reversed_turn, run_order
from .probes import measure_batch_variance, measure_layout_variance, probe_prefix
from .progress import Progress
from .prompts import BenchPrompt, default_prompts_path, load_prompts, prompt_grammar
from .report import BenchReport, ConfigResult, write_json
from .round_profile import RoundProfiler
from .shapes import chain_of, expand_configs, overlap_of, split_config
from .variants import TUNE, chain_config, held_out_winners, parse_params, sweep_configs, tree_mode

__all__ = ["BenchPrompt", "BenchReport", "ConfigResult", "classify_divergence", "cpu_steal_seconds",
           "default_prompts_path", "divergence_margin", "load_prompts", "main_bench", "measure_batch_variance",
           "measure_layout_variance", "run_bench", "write_json"]

# the names these had before the split into modules
_compare, _run_lockstep = compare_runs, run_lockstep


def run_bench(
    *,
    model: str,
    configs: list[str],
    prompts: list[BenchPrompt],
    max_tokens: int,
    slots: int,
    exact: bool,
    policy: str,
    n_max: int,
    threads: int,
    n_ctx: int,
    chat_template: str | None = None,
    llama_baseline: bool = True,
    progress=print,
    draft_model: str | None = None,
    cross_vocab: bool = False,
    draft: DraftModelConfig | None = None,
    repeats: int = 1,
    order: str = "lockstep",
    flash_attn: bool | None = None,
    n_gpu_layers: int | None = None,
    gpu_split: dict | None = None,
    progress_every: float = 10.0,
    verify_shape: str = "exact",
    verify_buckets: tuple[int, ...] | None = None,
    profiler: RoundProfiler | None = None,
    rollback: str = "auto",
    rollback_snapshots: int | None = None,
    spec_params: dict[str, dict] | None = None,
    hidden: HiddenStateConfig | None = None,
    host_replay: str | None = None,
) -> BenchReport:
    """Run every configuration on `prompts`, `repeats` times. Each pass has its own chains (fresh
    speculators: a second pass must not draft from what the first one generated) and runs the
    configurations in the opposite order of the pass, category and group before (order.reversed_turn),
    so a drift in machine speed, or a place in a lockstep round's turn order, cancels;
    `order`: `lockstep` (each configuration on its own context, all advanced a round at a time in turn:
    see lockstep.run_lockstep) or one of run_order's. `progress` gets the start-up figures, a line per
    category and configuration, and progress lines (prompt runs done, elapsed, ETA) at most every
    `progress_every` seconds and at the end of each category. `verify_shape`: exact, bucketed or both
    (shapes.expand_configs: a `CHAIN@bucketed` configuration runs on an engine with shape-stable verifies).
    Prompts too long for a sequence's share of the context are skipped, before anything runs, with a line
    saying which (fit.check_prompts); ValueError if none is left. `profiler`: cProfile each configuration's
    measured rounds (RoundProfiler). `spec_params`: every configuration's speculator parameters, under its own
    (bench/variants.py: `CHAIN/NAME.KEY=VALUE`, `CHAIN+tune`). `hidden`: the hidden-state heads (mtp, eagle3,
    dflash) the configurations may name; the target outputs rows only for sequences whose chain has one.
    `host_replay`: instead of the timed run, the host replay bench (host_replay.py: the target's decode replaced
    by a wait by this table), its results in meta["host_replay"]."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if "none" not in configs:
        configs = ["none"] + configs
    configs = expand_configs(configs, verify_shape)
    cfg = EngineConfig(model=model, chat_template=chat_template, slots=slots, exact=exact, flash_attn=flash_attn,
                       n_gpu_layers=n_gpu_layers, threads=threads, n_ctx=n_ctx, record_margins=True, rollback=rollback,
                       **({"rollback_snapshots": rollback_snapshots} if rollback_snapshots else {}),
                       **(gpu_split or {}),
                       **({"verify_buckets": tuple(verify_buckets)} if verify_buckets else {}),
                       # each configuration runs the same prompts: none may find them in the prompt cache
                       prompt_cache=False,
                       # the target gets branch ids where a configuration sends draft trees (CHAIN+trees)
                       chain=ChainConfig(speculators=[], policy=policy, n_max=n_max,
                                         trees=any(tree_mode(split_config(c)[0])[1] for c in configs)),
                       # `draft`: the whole draft config (its load options too); else the model and cross_vocab
                       draft=draft or DraftModelConfig(model=draft_model, cross_vocab=cross_vocab),
                       hidden=hidden or HiddenStateConfig())
    engine = LocalEngine(cfg)
    # in exact mode each slot has its own share of the context: a prompt that cannot fit would stop the run
    # midway, so such prompts are left out now (tokenized by the chat template, as the run will)
    fit, labels, skip_line = check_prompts(engine, prompts, configs, max_tokens)
    if not fit.kept:
        engine.close()
        raise ValueError(skip_line)
    if fit.skipped:
        progress(f"bench: {skip_line}")
        prompts = [prompts[i] for i in fit.kept]
    if host_replay is not None:
        return _host_replay_report(engine, cfg, configs, prompts, max_tokens, host_replay, spec_params, progress,
                                   profiler)
    # lockstep: a context, scheduler and verify-cost model of its own per configuration (one model, its
    # weights loaded once; every cost model starts from the same calibration); otherwise one engine per
    # verify shape (a `CHAIN@bucketed` configuration runs with shape-stable verifies: shapes.py)

    # a recurrent or hybrid target's context differs by whether it drafts: rollback snapshots are asked for only
    # where drafts are made (engine/rollback.py), so `none` runs on the plain context a plain server has
    recurrent = engine.model.memory_kind != "attention"

    def kind(c: str) -> tuple[str, bool, bool]:
        return shapes[c], recurrent and bool(chain_of(c)), overlap_of(c)[1]

    def new_engine(shape: str, drafts: bool, overlap: bool) -> LocalEngine:
        chain_cfg = cfg.chain.model_copy(update={"speculators": ["ngram_mod"] if drafts else []})
        e = LocalEngine(cfg.model_copy(update={"calibrate": False, "verify_shape": shape, "chain": chain_cfg,
                                               "overlap": overlap}),
                        model=engine.model)
        e.scheduler.cost = engine.scheduler.cost.copy()
        if engine.hidden_heads is not None and e.hidden_heads is not None:
            # the copies skip calibration: their heads start from the first engine's measured step costs (else the
            # cost policy would price a head step at its uncalibrated guess, 10 ms, until it had learnt better)
            calibrated = engine.hidden_heads.named()
            for name, head in e.hidden_heads.named().items():
                head.use_costs(calibrated[name].decode_costs())
        return e

    shapes = {c: split_config(c)[1] for c in configs}
    if order == "lockstep":
        engines = {c: engine if i == 0 and kind(c) == ("exact", False, False) else new_engine(*kind(c))
                   for i, c in enumerate(configs)}
    else:
        by_kind = {("exact", False, False): engine}
        for k in set(map(kind, configs)) - {("exact", False, False)}:
            by_kind[k] = new_engine(*k)
        engines = {c: by_kind[kind(c)] for c in configs}
    # each configuration's own chain: its parameters (--spec-param, then its own: variants.py), tuning or not
    # (and its own draft policy, pricing rounds with its engine's: DraftPolicy.for_chain)
    chains = [{c: engines[c].scheduler.policy.for_chain(
                   Chain(chain_config(split_config(c)[0], spec_params or {}, policy, n_max),
                         engines[c].speculator_factory)) for c in configs} for _ in range(repeats)]
    categories = list(dict.fromkeys(p.category for p in prompts))
    report = BenchReport(model=model, configs=list(configs), categories=categories)
    if llama_baseline and any(p.json_schema is not None or p.grammar is not None for p in prompts):
        progress("no llama_cpp reference row: llama_cpp.Llama's loop runs without the prompts' grammars")
        llama_baseline = False
    if llama_baseline and build_has_amx():
        # llama_cpp.Llama cannot turn weight repacking off, and repacking crashes on AMX builds
        progress("no llama_cpp reference row: this llama.cpp build has AMX kernels")
        llama_baseline = False
    if llama_baseline:
        report.configs.insert(1, "llama_cpp")
    if not exact:
        # the probes' context: the first prompt, a few times over (cut to what fits: any prompt file works)
        prefix = probe_prefix(engine.prompt_tokens(prompts[0].prompt, prompts[0].messages))
        # the largest verify batch a round can hold: every slot's last token + a full draft
        sizes = tuple(sorted({8, min(64, n_max + 1), min(64, slots * (n_max + 1))}))
        report.batch_variance = measure_batch_variance(engine, prefix, sizes)
        report.layout_variance = measure_layout_variance(engine, prefix)
    # an argmax flips only if the top-2 margin is below the two logits' combined drift
    report.tie_bound = 2.0 * max(report.batch_variance, report.layout_variance)
    report.meta = {"order": order, "slots": slots, "max_tokens": max_tokens, "exact": exact,
                   "verify_shape": verify_shape, "verify_buckets": list(cfg.verify_buckets),
                   "flash_attn": cfg.flash_attn_on, "policy": policy,
                   "n_max": n_max, "threads": threads, "n_gpu_layers": engine.model.n_gpu_layers,
                   # the draft model's settings as llama.cpp took them (its load options: docs/speculators.md)
                   "draft": engine.draft_model.effective_settings() if engine.draft_model is not None else None,
                   # hidden-state heads (eagle3, ...): file, taps, measured step cost by batch size
                   "hidden": engine.hidden_heads.info() if engine.hidden_heads is not None else None,
                   "verify_cols_kernel": verify_cols_enabled(),
                   # modules whose compiled core runs (engine/cores.py): else their Python reference
                   "compiled_cores": cores_in_use(),
                   "decode_cost_ms": {k: v * 1000 for k, v in engine.scheduler.cost.table().items()},
                   "attention_us_per_1k_token_cells": engine.scheduler.cost.attn_seconds * 1e9,
                   "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "n_ctx_seq": fit.n_ctx_seq, "skipped_prompts": len(fit.skipped),
                   "skipped": [{"prompt": labels[i], "cells": fit.cells[i]} for i in fit.skipped],
                   "profiled": profiler is not None,
                   # attention, recurrent or hybrid; per configuration, how its drafts are rolled back
                   "memory_kind": engine.model.memory_kind,
                   "rollback": {c: engines[c].scheduler.memory.rollback for c in configs}}
    if fit.skipped:
        report.meta["n_ctx_fitting_all"] = fit.n_ctx_all
    progress(f"model {model}: {engine.model.memory_kind} memory" + (
        f", drafts rolled back by {sorted(set(report.meta['rollback'].values()) - {'off'})}" if recurrent else ""))
    progress(f"model {model}: batch variance {report.batch_variance:.3f}, KV layout variance "
             f"{report.layout_variance:.3f}, tie bound {report.tie_bound:.3f}; "
             f"verify cost ms by batch size {({k: round(v, 1) for k, v in report.meta['decode_cost_ms'].items()})}")
    for name, info in (report.meta["hidden"] or {}).items():
        progress(f"{name} head {os.path.basename(info['model'])}: step cost ms by batch size "
                 f"{({k: round(v, 2) for k, v in info.get('decode_cost_ms', {}).items()})}")
    llama = PlainLlama(engine, threads, n_ctx) if llama_baseline else None
    # a prompt run: one prompt through one configuration's run (`sandwich` runs `none` several times a group)
    runs_per_prompt = len(run_order(report.configs, order, reverse=False))
    tracker = Progress(repeats * len(prompts) * runs_per_prompt, progress, every=progress_every)
    runs_done = 0  # prompt runs of the groups finished so far
    for ci, cat in enumerate(categories):
        cat_prompts = [p for p in prompts if p.category == cat]
        tokens = [engine.prompt_tokens(p.prompt, p.messages) for p in cat_prompts]
        grammars = [prompt_grammar(p) for p in cat_prompts]
        report.results[cat] = {c: ConfigResult(c) for c in report.configs}
        report.baselines[cat] = {c: ConfigResult("none") for c in report.configs}
        report.repeat_results[cat], report.repeat_baselines[cat] = [], []
        for rep in range(repeats):
            per_rep = {c: ConfigResult(c) for c in report.configs}
            base_rep = {c: ConfigResult("none") for c in report.configs}
            report.repeat_results[cat].append(per_rep)
            report.repeat_baselines[cat].append(base_rep)
            where = f"{cat}, pass {rep + 1}/{repeats}" if repeats > 1 else cat
            # configurations interleaved per group of prompts, so a load change on the machine hits every
            # configuration alike: one prompt at a time with one slot; with several slots the whole
            # category at once, queued, so a finished sequence's slot is refilled as on a loaded server
            # (closed groups of `slots` prompts would measure mostly batches emptying out, and a config
            # that finishes some sequences sooner would leave the all-slots-busy window sooner)
            step = 1 if slots == 1 else len(tokens)
            for gi, g in enumerate(range(0, len(tokens), step)):
                group, group_grammars = tokens[g : g + step], grammars[g : g + step]
                sequence = run_order(report.configs, order, reverse=reversed_turn(rep, ci, gi))
                runs: list[tuple[str, ConfigResult, list | None]] = []
                if order == "lockstep":
                    live = {c: LlamaRun(llama, group, max_tokens) if c == "llama_cpp" else
                            ConfigRun(engines[c], chains[rep][c], c, group, max_tokens, profiler, group_grammars)
                            for c in sequence}
                    done = run_lockstep(live, on_round=tracker.ticker(runs_done, live.values(), where))
                    runs = [(c, *done[c]) for c in sequence]
                else:
                    for i, c in enumerate(sequence):  # one after another, on the one engine
                        run = (LlamaRun(llama, group, max_tokens) if c == "llama_cpp" else
                               ConfigRun(engines[c], chains[rep][c], c, group, max_tokens, profiler, group_grammars))
                        runs.append((c, *run_alone(run, tracker.ticker(runs_done + i * len(group), [run], where))))
                runs_done += len(group) * len(sequence)
                base_seqs = next(seqs for c, _, seqs in runs if c == "none")
                for i, (c, r, seqs) in enumerate(runs):
                    if seqs is not None and c != "none":
                        compare_runs(r, base_seqs, seqs, 0.0 if exact else report.tie_bound)
                    per_rep[c].add(r)
                    report.results[cat][c].add(r)
                    for j in baseline_positions(sequence, i):
                        base_rep[c].add(runs[j][1])
                        report.baselines[cat][c].add(runs[j][1])
        tracker.report(runs_done, cat)
        for c in report.configs:
            r = report.results[cat][c]
            progress(f"{cat:<22} {c:<34} {r.tokens_per_s:7.1f} tok/s  accept_len {r.mean_acceptance_length:.2f}"
                     f"  identical {r.identical}/{r.compared}")
    # what online tuning ended on (CHAIN+tune configurations), per pass: speculator -> class -> choice, settings
    tuned = {c: [ch[c].snapshot()["tuning"] for ch in chains] for c in configs
             if chains[0][c].snapshot()["tuning"] is not None}
    if tuned:
        report.meta["tuning"] = tuned
        for c, passes in tuned.items():
            for name, classes in passes[-1].items():
                for cls, t in classes.items():
                    progress(f"{c}: {name} [{cls}] tuned to {t['choice']} "
                             f"({t['judged']} shadows judged)")
        held = {c: held_out_winners({k: report.repeat_speedups(k, report.categories) for k in report.configs},
                                    c[: -len(TUNE)]) for c in tuned}
        if any(held.values()):
            report.meta["tuning_held_out"] = held
            for c, rows in held.items():
                for w in rows:
                    progress(f"{c}: pass {w['pass']}: {w['tuned_speedup']:.3f}x against {w['winner_speedup']:.3f}x "
                             f"for {w['winner']} (the best on the other passes): {w['ratio']:.3f}")
    for e in {id(e): e for e in [engine, *engines.values()]}.values():
        e.close()
    return report


def _host_replay_report(engine: LocalEngine, cfg: EngineConfig, configs: list[str], prompts: list[BenchPrompt],
                        max_tokens: int, table_text: str, spec_params: dict | None, progress,
                        profiler: RoundProfiler | None = None) -> BenchReport:
    """run_bench's host replay: the report holds only meta (the table, each configuration's replayed run)."""
    try:
        table = parse_table(table_text, {n: s * 1e3 for n, s in engine.scheduler.cost.table().items()})

        def config_engine(c: str) -> LocalEngine:
            chain, shape = split_config(c)
            return LocalEngine(cfg.model_copy(update={"overlap": overlap_of(c)[1],
                # margins are the timed bench's instrumentation (ties), not a server's work
                "calibrate": False, "verify_shape": shape, "record_margins": False,
                "chain": chain_config(chain, spec_params or {}, cfg.chain.policy, cfg.chain.n_max)}),
                model=engine.model)

        results = run_host_replay(engine, configs, prompts, max_tokens, table, config_engine, progress, profiler)
    finally:
        engine.close()
    report = BenchReport(model=cfg.model, configs=list(configs), categories=[])
    report.meta = {"host_replay": {"decode_ms": table, "results": [r.to_dict() for r in results]},
                   "slots": cfg.slots, "max_tokens": max_tokens, "prompts": len(prompts),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    report.host_replay_text = replay_table_text(results, table)
    return report


def _check_writable(path: str | None, flag: str) -> None:
    """Refuse an output file whose folder does not exist before the run, not after an hour of it."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise FileNotFoundError(f"{flag} {path}: no such folder")


def main_bench(args) -> int:
    prompts_path = args.prompts or default_prompts_path()
    categories = [c for c in (args.categories or "").split(",") if c] or None
    prompts = load_prompts(prompts_path, categories, args.per_category)
    spec_params = parse_params(getattr(args, "spec_param", None) or [])
    configs = []
    for c in args.configs:
        chain_of(c)  # syntax check
        if c not in configs:
            configs.append(c)
    if getattr(args, "tune_sweep", False):
        from specray.engine.speculators.registry import make_params

        configs = sweep_configs(configs, spec_params, lambda name: make_params(name).model_dump())
    for c in configs:  # bad parameters fail now, not after the model has loaded
        chain_config(split_config(c)[0], spec_params, args.policy, args.n_max)
    plot = getattr(args, "plot", None)
    _check_writable(plot, "--plot")
    _check_writable(args.json, "--json")
    profile = getattr(args, "profile", None)
    _check_writable(profile, "--profile")
    profiler = RoundProfiler(replayed=getattr(args, "host_replay", None) is not None) if profile else None
    report = run_bench(model=args.model, configs=configs, prompts=prompts, max_tokens=args.max_tokens,
                       slots=args.slots, exact=args.exact, policy=args.policy, n_max=args.n_max,
                       threads=args.threads, n_ctx=args.n_ctx, chat_template=args.chat_template,
                       llama_baseline=not args.no_llama_baseline,
                       progress=lambda s: print(s, file=sys.stderr, flush=True),
                       draft=DraftModelConfig.from_flags(args), repeats=args.repeats,
                       order=args.order, flash_attn=args.flash_attn, n_gpu_layers=args.n_gpu_layers,
                       gpu_split={"main_gpu": args.main_gpu, "split_mode": args.split_mode,
                                  "tensor_split": args.tensor_split},
                       verify_shape=getattr(args, "verify_shape", "exact"),
                       verify_buckets=getattr(args, "verify_buckets", None), profiler=profiler,
                       rollback=args.rollback, rollback_snapshots=args.rollback_snapshots, spec_params=spec_params,
                       hidden=HiddenStateConfig(**flag_values(args, "hidden")),
                       host_replay=getattr(args, "host_replay", None))
    print(report.host_replay_text if report.host_replay_text else report.table())
    if args.json:
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    if plot and not report.host_replay_text:
        from .plot import plot_bench

        plot_bench(report, plot)
        print(f"plot: {plot}", file=sys.stderr)
    if profiler is not None:
        profiler.write(profile)
        print(f"profile: {profile}", file=sys.stderr)
    return 0
