"""`specray bench`: speculator chains against no speculation, in one run.

Every configuration runs the same prompts on the same loaded model, category
by category, configurations interleaved so that machine drift hits them all
alike. At temperature 0 each configuration's tokens are compared with
`none`'s: a divergence whose first differing position had a top-2 logit
margin (in the `none` run) below the tie bound counts as `tie_divergence`
(llama.cpp's CPU kernels are not batch-invariant, so near-ties may flip),
anything else as a `mismatch`. With --exact every divergence is a mismatch.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig, parse_chain
from specray.engine.request import GenerationRequest, SpecCounters
from specray.native.lib import build_has_amx, verify_cols_enabled

from .bench_order import ORDERS, baseline_positions, reversed_turn, run_order
from .local_engine import LocalEngine

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC_BENCH_CANDIDATES = [
    os.environ.get("SPECRAY_SPEC_BENCH", ""),
    str(REPO_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"),
    str(REPO_ROOT / "shared" / "data" / "spec_bench" / "question.jsonl"),
]


def default_prompts_path() -> str:
    for p in SPEC_BENCH_CANDIDATES:
        if p and os.path.isfile(p):
            return p
    raise FileNotFoundError(
        "Spec-Bench questions not found (looked in ../shared/data/spec_bench/question.jsonl); "
        "pass --prompts FILE.jsonl or set SPECRAY_SPEC_BENCH"
    )


@dataclass
class BenchPrompt:
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None


def load_prompts(path: str, categories: list[str] | None, per_category: int | None) -> list[BenchPrompt]:
    """JSONL with `prompt` (raw text) or `messages` (chat), or Spec-Bench's `turns`; optional `category`."""
    out: list[BenchPrompt] = []
    counts: dict[str, int] = defaultdict(int)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            cat = str(obj.get("category", "default"))
            if categories and cat not in categories:
                continue
            if per_category is not None and counts[cat] >= per_category:
                continue
            if "prompt" in obj:
                bp = BenchPrompt(cat, prompt=str(obj["prompt"]))
            elif "messages" in obj:
                bp = BenchPrompt(cat, messages=list(obj["messages"]))
            elif "turns" in obj:
                bp = BenchPrompt(cat, messages=[{"role": "user", "content": obj["turns"][0]}])
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt', 'messages' or 'turns'")
            counts[cat] += 1
            out.append(bp)
    if not out:
        raise ValueError(f"no prompts selected from {path} (categories={categories})")
    return out


@dataclass
class ConfigResult:
    name: str
    tokens: int = 0
    seconds: float = 0.0  # wall time, prompt processing included
    prefill_seconds: float = 0.0  # the part of `seconds` spent on prompt rows
    sequences: int = 0  # each sequence's first token comes out of its prompt's last batch
    loaded_seconds: float = 0.0  # rounds with every slot generating (see RoundStats)
    loaded_tokens: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    mismatches: int = 0
    tie_divergences: int = 0
    identical: int = 0
    compared: int = 0
    steal_seconds: float = 0.0  # CPU time the hypervisor gave to others while this ran (/proc/stat steal)
    rounds: int = 0  # scheduler rounds (draft -> verify -> accept), for the time split per round
    draft_seconds: float = 0.0  # time in speculators' draft calls (model drafting included)
    verify_seconds: float = 0.0  # time in target decodes (verification and prompt rows)
    # the drafts each speculator of a chain got sent (it won the round): which one carries the chain
    by_speculator: dict[str, SpecCounters] = field(default_factory=dict)
    # the `none` run's top-2 margin where each mismatch began: how far above the tie bound it lay
    mismatch_margins: list[float] = field(default_factory=list)

    def add(self, other: "ConfigResult") -> None:
        for k in ("tokens", "seconds", "prefill_seconds", "sequences", "loaded_seconds", "loaded_tokens", "drafts",
                  "drafted", "accepted", "mismatches", "tie_divergences", "identical", "compared", "steal_seconds",
                  "rounds", "draft_seconds", "verify_seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.mismatch_margins = self.mismatch_margins + other.mismatch_margins
        for name, c in other.by_speculator.items():
            mine = self.by_speculator.setdefault(name, SpecCounters())
            mine.drafts, mine.drafted, mine.accepted = (mine.drafts + c.drafts, mine.drafted + c.drafted,
                                                        mine.accepted + c.accepted)

    @property
    def tokens_per_s(self) -> float:
        """Generation speed under full load: tokens emitted in rounds where every slot was generating,
        over those rounds' time. With one slot that is llama.cpp's "predicted per second" (the issue's
        anchors are in this unit); with N slots, the aggregate throughput of N busy slots, without the
        tail of a closed batch where the last sequences run alone (a loaded server refills its slots)."""
        if self.loaded_seconds > 0:
            return self.loaded_tokens / self.loaded_seconds
        t = self.seconds - self.prefill_seconds
        return max(0, self.tokens - self.sequences) / t if t > 0 else 0.0

    @property
    def e2e_tokens_per_s(self) -> float:
        """All generated tokens over wall time, prompt processing included."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class BenchReport:
    model: str
    configs: list[str]
    categories: list[str]
    results: dict[str, dict[str, ConfigResult]] = field(default_factory=dict)  # cat -> config -> result
    # cat -> repeat -> config -> result (`results` sums them); one entry per --repeats pass
    repeat_results: dict[str, list[dict[str, ConfigResult]]] = field(default_factory=dict)
    # cat -> config -> the `none` runs each configuration is measured against (its neighbours in the run
    # order with --order sandwich; the group's one `none` run with --order alternate); same for each pass
    baselines: dict[str, dict[str, ConfigResult]] = field(default_factory=dict)
    repeat_baselines: dict[str, list[dict[str, ConfigResult]]] = field(default_factory=dict)
    tie_bound: float = 0.0
    batch_variance: float = 0.0
    layout_variance: float = 0.0
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict = {"model": self.model, "tie_bound": self.tie_bound, "batch_variance": self.batch_variance,
                     "layout_variance": self.layout_variance, "meta": self.meta, "configs": {}}
        for cfg in self.configs:
            cats = {}
            total = ConfigResult(cfg)
            base_total = ConfigResult("none")
            for cat in self.categories:
                r = self.results[cat][cfg]
                base = self._baseline(cat, cfg)
                total.add(r)
                if base is not None:
                    base_total.add(base)
                cats[cat] = self._row(r, base)
            overall = self._row(total, base_total if "none" in self.configs else None)
            if "none" in self.configs:
                for cat in self.categories:
                    cats[cat]["speedup_per_repeat"] = self.repeat_speedups(cfg, [cat])
                overall["speedup_per_repeat"] = self.repeat_speedups(cfg, self.categories)
            entry = {"mismatches": total.mismatches, "mismatch_margins": [round(m, 4) for m in total.mismatch_margins],
                     "tie_divergences": total.tie_divergences,
                     "identical": total.identical, "compared": total.compared, "categories": cats,
                     "overall": overall}
            out["configs"][cfg] = entry
        return out

    def _baseline(self, cat: str, cfg: str, rep: int | None = None) -> ConfigResult | None:
        if rep is None:
            by_cfg, results = self.baselines.get(cat, {}), self.results[cat]
        else:
            passes = self.repeat_baselines.get(cat, [])
            by_cfg, results = passes[rep] if rep < len(passes) else {}, self.repeat_results[cat][rep]
        return by_cfg.get(cfg, results.get("none"))

    def repeat_speedups(self, cfg: str, categories: list[str]) -> list[float]:
        """Speedup vs `none` of each --repeats pass over `categories` (their spread shows the noise)."""
        out = []
        n_rep = min((len(self.repeat_results.get(c, [])) for c in categories), default=0)
        for rep in range(n_rep):
            r, base = ConfigResult(cfg), ConfigResult("none")
            for cat in categories:
                r.add(self.repeat_results[cat][rep][cfg])
                base.add(self._baseline(cat, cfg, rep))
            out.append(r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0)
        return out

    @staticmethod
    def _row(r: ConfigResult, base: ConfigResult | None) -> dict:
        speedup = r.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s else None
        e2e = r.e2e_tokens_per_s / base.e2e_tokens_per_s if base is not None and base.e2e_tokens_per_s else None
        return {"tokens_per_s": r.tokens_per_s, "mean_acceptance_length": r.mean_acceptance_length,
                "acceptance_rate": r.acceptance_rate, "speedup": speedup, "e2e_tokens_per_s": r.e2e_tokens_per_s,
                "e2e_speedup": e2e, "tokens": r.tokens, "seconds": r.seconds, "prefill_seconds": r.prefill_seconds,
                "drafts": r.drafts, "drafted_tokens": r.drafted,
                "accepted_tokens": r.accepted, "steal_seconds": r.steal_seconds, "rounds": r.rounds,
                "round_ms": 1000 * r.seconds / r.rounds if r.rounds else None,
                "draft_ms_per_round": 1000 * r.draft_seconds / r.rounds if r.rounds else None,
                "verify_ms_per_round": 1000 * r.verify_seconds / r.rounds if r.rounds else None,
                "by_speculator": {k: v.to_dict() for k, v in sorted(r.by_speculator.items())}}

    def table(self) -> str:
        js = self.to_json()
        lines = []
        spread = max((len(v) for v in self.repeat_results.values()), default=0) > 1
        for cat in self.categories + ["overall"]:
            lines.append(f"\n== {cat} ==")
            lines.append(f"{'config':<34}{'tok/s':>8}{'speedup':>9}{'range' if spread else '':>12}{'e2e':>7}"
                         f"{'accept_len':>11}{'acc_rate':>9}{'mismatch':>9}{'ties':>6}{'round_ms':>9}{'draft':>7}"
                         f"{'verify':>7}")
            for cfg in self.configs:
                entry = js["configs"][cfg]
                row = entry["overall"] if cat == "overall" else entry["categories"][cat]
                sp, e2e = row["speedup"], row["e2e_speedup"]
                mm = entry["mismatches"] if cat == "overall" else ""
                ties = entry["tie_divergences"] if cat == "overall" else ""
                per_rep = row.get("speedup_per_repeat") or []
                rng = f"{min(per_rep):.2f}-{max(per_rep):.2f}" if spread and per_rep else ""
                lines.append(
                    f"{cfg:<34}{row['tokens_per_s']:>8.1f}{(f'{sp:.2f}x' if sp is not None else '-'):>9}{rng:>12}"
                    f"{(f'{e2e:.2f}x' if e2e is not None else '-'):>7}"
                    f"{row['mean_acceptance_length']:>11.2f}{row['acceptance_rate']:>9.2f}{mm!s:>9}{ties!s:>6}"
                    f"{_ms(row['round_ms']):>9}{_ms(row['draft_ms_per_round']):>7}{_ms(row['verify_ms_per_round']):>7}"
                )
        lines.extend(self.winner_lines(js))
        lines.extend(self.steal_warnings())
        return "\n".join(lines)

    def winner_lines(self, js: dict) -> list[str]:
        """For chains of several speculators: whose drafts were sent, how many and how well they did."""
        out = []
        for cfg in self.configs:
            won = js["configs"][cfg]["overall"]["by_speculator"]
            if len(cfg.split(",")) < 2 or not won:
                continue
            if not out:
                out.append("\n== drafts sent, by speculator (overall): drafts, acceptance rate ==")
            out.append(f"{cfg:<33} " + "  ".join(f"{k} {v['drafts']} ({v['acceptance_rate']:.2f})"
                                                for k, v in won.items()))
        return out

    def steal_warnings(self) -> list[str]:
        """A line per configuration whose run lost more than 2% of its time to the hypervisor (its
        figures are suspect: the host ran other machines' work on these cores)."""
        out = []
        for cfg in self.configs:
            steal = sum(self.results[c][cfg].steal_seconds for c in self.categories)
            wall = sum(self.results[c][cfg].seconds for c in self.categories)
            if wall > 0 and steal / wall > 0.02:
                out.append(f"warning: {cfg}: {steal:.1f} s of {wall:.1f} s stolen by the host "
                           f"({100 * steal / wall:.0f}%); its figures are unreliable, run again")
        return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def cpu_steal_seconds() -> float:
    """CPU seconds the hypervisor has stolen from this machine since boot (0 where /proc/stat says nothing)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def measure_batch_variance(engine: LocalEngine, prefix_tokens: np.ndarray, n: int | tuple[int, ...] = 8) -> float:
    """Largest |logit| difference between n tokens decoded in one batch and one by one
    (the largest over several batch sizes if n is a tuple: kernels switch with the row count)."""
    if not isinstance(n, int):
        return max(measure_batch_variance(engine, prefix_tokens, k) for k in n)
    ctx = engine.ctx
    slot = engine.config.slots - 1
    b = ctx.batch
    p = prefix_tokens[: min(len(prefix_tokens), ctx.n_ctx // 2)]
    nxt = _probe_tokens(engine, n)
    ctx.clear_seq(slot)
    b.clear(); b.add_seq(slot, p, 0, 1); ctx.decode(b)  # noqa: E702
    b.clear(); b.add_seq(slot, nxt, len(p), n); batched = ctx.decode(b).copy()  # noqa: E702
    ctx.seq_rm(slot, len(p), -1)
    ones = _decode_one_by_one(ctx, slot, nxt, len(p))
    ctx.clear_seq(slot)
    return float(np.abs(batched - ones).max())


def _probe_tokens(engine: LocalEngine, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) * 97 + 500) % engine.model.n_vocab


def _decode_one_by_one(ctx, slot: int, tokens: np.ndarray, pos0: int) -> np.ndarray:
    """Logits of `tokens` decoded one per batch at positions pos0..., stacked."""
    b, out = ctx.batch, []
    for i in range(len(tokens)):
        b.clear(); b.add_seq(slot, tokens[i : i + 1], pos0 + i, 1)  # noqa: E702
        out.append(ctx.decode(b)[0].copy())
    return np.stack(out)


def measure_layout_variance(engine: LocalEngine, prefix_tokens: np.ndarray, n: int = 8) -> float:
    """Largest |logit| difference for the same tokens of one sequence when its KV cells lie alone and when
    they are interleaved with another sequence's (0 with one slot or one KV stream per slot). Kernels that
    sum attention over KV tiles (flash attention) skip or pad them by layout, so with several slots a
    sequence's logits depend on where its neighbours' cells lie, which measure_batch_variance never sees."""
    ctx = engine.ctx
    if engine.config.slots < 2 or not ctx.kv_unified:
        return 0.0
    s, t = engine.config.slots - 1, engine.config.slots - 2
    p = prefix_tokens[: min(len(prefix_tokens), ctx.n_ctx // 4)]
    nxt = _probe_tokens(engine, n)
    step = max(1, ctx.n_batch // 2)

    def probe(interleaved: bool) -> np.ndarray:
        b = ctx.batch
        ctx.clear_seq(s); ctx.clear_seq(t)  # noqa: E702
        for c in range(0, len(p), step):
            b.clear()
            for i in range(c, min(len(p), c + step)):
                b.add_seq(s, p[i : i + 1], i, 1 if i == len(p) - 1 else 0)
                if interleaved:
                    b.add_seq(t, p[i : i + 1], i, 0)
            ctx.decode(b)
        out = _decode_one_by_one(ctx, s, nxt, len(p))
        ctx.clear_seq(s); ctx.clear_seq(t)  # noqa: E702
        return out

    return float(np.abs(probe(False) - probe(True)).max())


def divergence_margin(base_tokens: list[int], tokens: list[int], base_margins: list[float]) -> float | None:
    """The `none` run's top-2 logit margin where `tokens` first differs from `base_tokens` (None: identical;
    if one stopped early, EOS vs a different token, the stop position decides; inf: no margin recorded)."""
    n = min(len(base_tokens), len(tokens))
    i = next((i for i in range(n) if base_tokens[i] != tokens[i]), None)
    if i is None:
        if len(base_tokens) == len(tokens):
            return None
        i = n
    return float(base_margins[i]) if i < len(base_margins) else float("inf")


def classify_divergence(base_tokens: list[int], tokens: list[int], base_margins: list[float],
                        tie_bound: float) -> str:
    """'identical', 'tie_divergence' or 'mismatch' (first differing position decides)."""
    margin = divergence_margin(base_tokens, tokens, base_margins)
    if margin is None:
        return "identical"
    return "tie_divergence" if margin <= tie_bound else "mismatch"


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
    repeats: int = 1,
    order: str = "lockstep",
    flash_attn: bool = False,
) -> BenchReport:
    """Run every configuration on `prompts`, `repeats` times. Each pass has its own chains (fresh
    speculators: a second pass must not draft from what the first one generated) and runs the
    configurations in the opposite order of the pass, category and group before (bench_order.reversed_turn),
    so a drift in machine speed, or a place in a lockstep round's turn order, cancels;
    `order`: `lockstep` (each configuration on its own context, all advanced a round at a time in turn:
    see _run_lockstep) or one of run_order's."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if "none" not in configs:
        configs = ["none"] + configs
    cfg = EngineConfig(model=model, chat_template=chat_template, slots=slots, exact=exact, flash_attn=flash_attn,
                       threads=threads, n_ctx=n_ctx, record_margins=True,
                       chain=ChainConfig(speculators=[], policy=policy, n_max=n_max),
                       draft=DraftModelConfig(model=draft_model, cross_vocab=cross_vocab))
    engine = LocalEngine(cfg)
    # lockstep: a context, scheduler and verify-cost model of its own per configuration (one model, its
    # weights loaded once; every cost model starts from the same calibration); otherwise one engine
    engines = {c: engine for c in configs}
    if order == "lockstep":
        for c in configs[1:]:
            engines[c] = LocalEngine(cfg.model_copy(update={"calibrate": False}), model=engine.model)
            engines[c].scheduler.cost = engine.scheduler.cost.copy()
    chains = [{c: Chain(ChainConfig(speculators=parse_chain(c), policy=policy, n_max=n_max),
                        engines[c].speculator_factory) for c in configs} for _ in range(repeats)]
    categories = list(dict.fromkeys(p.category for p in prompts))
    report = BenchReport(model=model, configs=list(configs), categories=categories)
    if llama_baseline and build_has_amx():
        # llama_cpp.Llama cannot turn weight repacking off, and repacking crashes on AMX builds
        progress("no llama_cpp reference row: this llama.cpp build has AMX kernels")
        llama_baseline = False
    if llama_baseline:
        report.configs.insert(1, "llama_cpp")
    sample = engine.prompt_tokens(prompts[0].prompt, prompts[0].messages)
    # the largest verify batch a round can hold: every slot's last token + a full draft
    sizes = tuple(sorted({8, min(64, n_max + 1), min(64, slots * (n_max + 1))}))
    report.batch_variance = 0.0 if exact else measure_batch_variance(engine, np.tile(sample, 4), sizes)
    report.layout_variance = 0.0 if exact else measure_layout_variance(engine, np.tile(sample, 4))
    # an argmax flips only if the top-2 margin is below the two logits' combined drift
    report.tie_bound = 2.0 * max(report.batch_variance, report.layout_variance)
    report.meta = {"order": order, "slots": slots, "max_tokens": max_tokens, "exact": exact,
                   "flash_attn": flash_attn, "policy": policy,
                   "n_max": n_max, "threads": threads, "verify_cols_kernel": verify_cols_enabled(),
                   "decode_cost_ms": {k: v * 1000 for k, v in engine.scheduler.cost.table().items()},
                   "attention_us_per_1k_token_cells": engine.scheduler.cost.attn_seconds * 1e9,
                   "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    progress(f"model {model}: batch variance {report.batch_variance:.3f}, KV layout variance "
             f"{report.layout_variance:.3f}, tie bound {report.tie_bound:.3f}; "
             f"verify cost ms by batch size {({k: round(v, 1) for k, v in report.meta['decode_cost_ms'].items()})}")
    llama = _PlainLlama(engine, threads, n_ctx) if llama_baseline else None
    for ci, cat in enumerate(categories):
        cat_prompts = [p for p in prompts if p.category == cat]
        tokens = [engine.prompt_tokens(p.prompt, p.messages) for p in cat_prompts]
        report.results[cat] = {c: ConfigResult(c) for c in report.configs}
        report.baselines[cat] = {c: ConfigResult("none") for c in report.configs}
        report.repeat_results[cat], report.repeat_baselines[cat] = [], []
        for rep in range(repeats):
            per_rep = {c: ConfigResult(c) for c in report.configs}
            base_rep = {c: ConfigResult("none") for c in report.configs}
            report.repeat_results[cat].append(per_rep)
            report.repeat_baselines[cat].append(base_rep)
            # configurations interleaved per group of prompts, so a load change on the machine hits every
            # configuration alike: one prompt at a time with one slot; with several slots the whole
            # category at once, queued, so a finished sequence's slot is refilled as on a loaded server
            # (closed groups of `slots` prompts would measure mostly batches emptying out, and a config
            # that finishes some sequences sooner would leave the all-slots-busy window sooner)
            step = 1 if slots == 1 else len(tokens)
            for gi, g in enumerate(range(0, len(tokens), step)):
                group = tokens[g : g + step]
                sequence = run_order(report.configs, order, reverse=reversed_turn(rep, ci, gi))
                runs: list[tuple[str, ConfigResult, list | None]] = []
                if order == "lockstep":
                    done = _run_lockstep({c: _LlamaRun(llama, group, max_tokens) if c == "llama_cpp" else
                                          _ConfigRun(engines[c], chains[rep][c], c, group, max_tokens)
                                          for c in sequence})
                    runs = [(c, *done[c]) for c in sequence]
                else:
                    for c in sequence:
                        if c == "llama_cpp":
                            runs.append((c, llama.run(group, max_tokens), None))
                        else:
                            runs.append((c, *_run_config(engine, chains[rep][c], c, group, max_tokens)))
                base_seqs = next(seqs for c, _, seqs in runs if c == "none")
                for i, (c, r, seqs) in enumerate(runs):
                    if seqs is not None and c != "none":
                        _compare(r, base_seqs, seqs, 0.0 if exact else report.tie_bound)
                    per_rep[c].add(r)
                    report.results[cat][c].add(r)
                    for j in baseline_positions(sequence, i):
                        base_rep[c].add(runs[j][1])
                        report.baselines[cat][c].add(runs[j][1])
        for c in report.configs:
            r = report.results[cat][c]
            progress(f"{cat:<22} {c:<34} {r.tokens_per_s:7.1f} tok/s  accept_len {r.mean_acceptance_length:.2f}"
                     f"  identical {r.identical}/{r.compared}")
    for e in {id(e): e for e in engines.values()}.values():
        e.close()
    return report


def _compare(r: ConfigResult, base_seqs: list, seqs: list, tie_bound: float) -> None:
    """Count each sequence of `seqs` as identical to, tie-diverging from or mismatching `none`'s."""
    for b, s in zip(base_seqs, seqs):
        kind = classify_divergence(b.generated, s.generated, b.margins, tie_bound)
        r.compared += 1
        if kind == "identical":
            r.identical += 1
        elif kind == "mismatch":
            r.mismatches += 1
            r.mismatch_margins.append(divergence_margin(b.generated, s.generated, b.margins))
        else:
            r.tie_divergences += 1


class _ConfigRun:
    """One configuration's requests on an engine, from submission to the result: run at once, or a round
    at a time (lockstep) with only its own rounds' time counted."""

    def __init__(self, engine: LocalEngine, chain: Chain, name: str, prompts: list[np.ndarray],
                 max_tokens: int) -> None:
        self.engine, self.name = engine, name
        engine.scheduler.chain = chain
        reqs = [GenerationRequest(prompt_tokens=t, max_tokens=max_tokens, chain=tuple(parse_chain(name)))
                for t in prompts]
        st = engine.scheduler.stats
        self.before = (st.prefill_seconds, st.loaded_seconds, st.loaded_tokens, st.rounds, st.draft_seconds,
                       st.target_seconds)
        self.seqs = [engine.submit(r) for r in reqs]
        self.seconds = 0.0

    def step(self) -> bool:
        """One round; False once every request has finished."""
        t0 = time.perf_counter()
        self.engine.step()
        self.seconds += time.perf_counter() - t0
        return self.engine.scheduler.has_work()

    def result(self, steal_seconds: float) -> tuple[ConfigResult, list]:
        st, before, name = self.engine.scheduler.stats, self.before, self.name
        r = ConfigResult(name, seconds=self.seconds, prefill_seconds=st.prefill_seconds - before[0],
                         steal_seconds=steal_seconds,
                         loaded_seconds=st.loaded_seconds - before[1], loaded_tokens=st.loaded_tokens - before[2],
                         rounds=st.rounds - before[3], draft_seconds=st.draft_seconds - before[4],
                         verify_seconds=st.target_seconds - before[5])
        for s in self.seqs:
            r.sequences += 1 if s.generated else 0
            r.tokens += len(s.generated)
            r.drafts += s.spec_total.drafts
            r.drafted += s.spec_total.drafted
            r.accepted += s.spec_total.accepted
            r.add(ConfigResult(name, by_speculator=s.spec_by_name))
        return r, self.seqs


def _run_config(engine: LocalEngine, chain: Chain, name: str, prompts: list[np.ndarray],
                max_tokens: int) -> tuple[ConfigResult, list]:
    steal0 = cpu_steal_seconds()
    run = _ConfigRun(engine, chain, name, prompts, max_tokens)
    while run.step():
        pass
    return run.result(cpu_steal_seconds() - steal0)


def _run_lockstep(runs: dict[str, "_ConfigRun | _LlamaRun"]) -> dict[str, tuple[ConfigResult, list | None]]:
    """Advance every configuration's run by one round in turn until all have finished, timing each round:
    the machine's speed drifts by 20% and more over tens of seconds on these shared VMs, and rounds of
    all configurations taken within milliseconds of each other see the same speed, so the drift cancels.
    The host's stolen time is shared out by each configuration's share of the time."""
    steal0 = cpu_steal_seconds()
    active = list(runs)
    while active:
        active = [c for c in active if runs[c].step()]
    steal = cpu_steal_seconds() - steal0
    total = sum(r.seconds for r in runs.values()) or 1.0
    return {c: r.result(steal * r.seconds / total) for c, r in runs.items()}


class _PlainLlama:
    """llama_cpp.Llama's own greedy generate, same model file and threads: the reference loop."""

    def __init__(self, engine: LocalEngine, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=engine.model.path, n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.eog = engine.model.eog_ids

    def run(self, prompts: list[np.ndarray], max_tokens: int) -> ConfigResult:
        steal0 = cpu_steal_seconds()
        run = _LlamaRun(self, prompts, max_tokens)
        while run.step():
            pass
        return run.result(cpu_steal_seconds() - steal0)[0]


class _LlamaRun:
    """The reference loop on a group of prompts, a decode at a time (for lockstep)."""

    def __init__(self, llama: _PlainLlama, prompts: list[np.ndarray], max_tokens: int) -> None:
        self.r = ConfigResult("llama_cpp")
        self.seconds = 0.0
        self._decodes = self._generate(llama, prompts, max_tokens)

    def _generate(self, llama: _PlainLlama, prompts: list[np.ndarray], max_tokens: int):
        """Yields after each decode: "prompt" for the one that processes a prompt, else "token"."""
        for toks in prompts:
            llama.llm.reset()
            n = 0
            for t in llama.llm.generate(toks.tolist(), temp=0.0, top_k=1, reset=True):
                kind = "prompt" if n == 0 else "token"
                if t in llama.eog:
                    yield kind
                    break
                n += 1
                self.r.tokens += 1
                yield kind
                if n >= max_tokens:
                    break
            self.r.sequences += 1 if n else 0

    def step(self) -> bool:
        t0 = time.perf_counter()
        kind = next(self._decodes, None)
        dt = time.perf_counter() - t0
        self.seconds += dt
        if kind == "prompt":  # prompt processing ends with the first token
            self.r.prefill_seconds += dt
        return kind is not None

    def result(self, steal_seconds: float) -> tuple[ConfigResult, None]:
        self.r.seconds, self.r.steal_seconds = self.seconds, steal_seconds
        return self.r, None


def write_json(report: BenchReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)


def main_bench(args) -> int:
    prompts_path = args.prompts or default_prompts_path()
    categories = [c for c in (args.categories or "").split(",") if c] or None
    prompts = load_prompts(prompts_path, categories, args.per_category)
    configs = []
    for c in args.configs:
        parse_chain(c)  # syntax check
        if c not in configs:
            configs.append(c)
    report = run_bench(model=args.model, configs=configs, prompts=prompts, max_tokens=args.max_tokens,
                       slots=args.slots, exact=args.exact, policy=args.policy, n_max=args.n_max,
                       threads=args.threads, n_ctx=args.n_ctx, chat_template=args.chat_template,
                       llama_baseline=not args.no_llama_baseline,
                       progress=lambda s: print(s, file=sys.stderr, flush=True),
                       draft_model=args.draft_model, cross_vocab=args.cross_vocab, repeats=args.repeats,
                       order=args.order, flash_attn=args.flash_attn)
    print(report.table())
    if args.json:
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    return 0
