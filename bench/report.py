"""`specray bench`'s figures: one configuration's counters (ConfigResult), and the report over categories,
configurations and passes (BenchReport: speedups against `none`, the table, the JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specray.engine.request import SpecCounters
from specray.engine.round_stages import STAGES, breakdown


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
    # the scheduler's rounds by stage (engine/round_stages.py), decoding sequences summed over rounds, and each
    # speculator's draft calls: seconds and the sequences it was asked for
    stage_seconds: dict[str, float] = field(default_factory=dict)
    seq_rounds: int = 0
    speculator_seconds: dict[str, float] = field(default_factory=dict)
    speculator_asks: dict[str, int] = field(default_factory=dict)
    # the drafts each speculator of a chain got sent (it won the round): which one carries the chain
    by_speculator: dict[str, SpecCounters] = field(default_factory=dict)
    # the `none` run's top-2 margin where each mismatch began: how far above the tie bound it lay
    mismatch_margins: list[float] = field(default_factory=list)
    # a recurrent target's rollback work (engine/rollback.py RollbackStats, summed) and sequences that failed
    rollback: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    # draft trees (engine/policy/trees.py): rounds with a draft sent, of them rounds with a tree; trees sent,
    # their runner-up branches, and trees whose accepted path left the main draft
    draft_rounds: int = 0
    tree_rounds: int = 0
    tree_drafts: int = 0
    tree_branches: int = 0
    runner_ups_taken: int = 0

    def add(self, other: "ConfigResult") -> None:
        for k in ("tokens", "seconds", "prefill_seconds", "sequences", "loaded_seconds", "loaded_tokens", "drafts",
                  "drafted", "accepted", "mismatches", "tie_divergences", "identical", "compared", "steal_seconds",
                  "rounds", "draft_seconds", "verify_seconds", "seq_rounds", "failed", "draft_rounds",
                  "tree_rounds", "tree_drafts", "tree_branches", "runner_ups_taken"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k in ("stage_seconds", "speculator_seconds", "speculator_asks", "rollback"):
            mine, theirs = getattr(self, k), getattr(other, k)
            setattr(self, k, {n: mine.get(n, 0) + theirs.get(n, 0) for n in {**mine, **theirs}})
        self.mismatch_margins = self.mismatch_margins + other.mismatch_margins
        for name, c in other.by_speculator.items():
            mine = self.by_speculator.setdefault(name, SpecCounters())
            mine.drafts, mine.drafted, mine.accepted = (mine.drafts + c.drafts, mine.drafted + c.drafted,
                                                        mine.accepted + c.accepted)

    @property
    def tokens_per_s(self) -> float:
        """Generation speed under full load: tokens emitted in rounds where every slot was generating,
        over those rounds' time. With one slot that is llama.cpp's "predicted per second" (so it
        compares with llama.cpp's own figures); with N slots, the aggregate throughput of N busy slots, without the
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
    host_replay_text: str = ""  # --host-replay: its table (the report then holds only meta)

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
                "round_stages": breakdown(r.stage_seconds, r.rounds, r.seq_rounds)
                | {"speculator_ms_per_ask": {k: 1000 * v / r.speculator_asks[k]
                                              for k, v in sorted(r.speculator_seconds.items())
                                              if r.speculator_asks.get(k)}},
                "by_speculator": {k: v.to_dict() for k, v in sorted(r.by_speculator.items())},
                "failed_sequences": r.failed, "rollback": rollback_row(r.rollback, r.rounds),
                # verify rows per round: each decoding sequence's own row and its draft rows (a tree's nodes)
                "rows_per_round": (r.seq_rounds + r.drafted) / r.rounds if r.rounds else None,
                "trees": {"tree_round_share": r.tree_rounds / r.draft_rounds if r.draft_rounds else 0.0,
                          "tree_drafts": r.tree_drafts, "branches": r.tree_branches,
                          "runner_ups_taken": r.runner_ups_taken}}

    def table(self) -> str:
        js = self.to_json()
        lines = []
        spread = max((len(v) for v in self.repeat_results.values()), default=0) > 1
        for cat in self.categories + ["overall"]:
            lines.append(f"\n== {cat} ==")
            lines.append(f"{'config':<34}{'tok/s':>8}{'speedup':>9}{'range' if spread else '':>12}{'e2e':>7}"
                         f"{'accept_len':>11}{'acc_rate':>9}{'mismatch':>9}{'ties':>6}{'round_ms':>9}{'draft':>7}"
                         f"{'verify':>7}{'host':>6}{'rows':>6}{'trees':>6}")
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
                    f"{_ms(row['round_stages']['host_ms_per_round'], 2):>6}"
                    f"{_ms(row['rows_per_round']):>6}{_share(row['trees']['tree_round_share']):>6}"
                )
        lines.extend(self.winner_lines(js))
        lines.extend(self.stage_lines(js))
        lines.extend(self.rollback_lines(js))
        lines.extend(self.steal_warnings())
        lines.extend(self.skip_lines())
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

    def stage_lines(self, js: dict) -> list[str]:
        """The round's time by stage (overall, ms per round): `decode` is the target's llama_decode, every other
        stage is host work; host per round and per decoding sequence-round; each speculator's look-up cost."""
        rows = {cfg: js["configs"][cfg]["overall"]["round_stages"] for cfg in self.configs}
        stages = [k for k in STAGES if any(k in r["ms_per_round"] for r in rows.values())]
        if not stages:
            return []
        out = ["\n== round stages (overall): ms per round; host = all but decode, per round and per decoding "
               "sequence-round =="]
        out.append(f"{'config':<34}" + "".join(f"{k:>{max(9, len(k) + 2)}}" for k in stages)
                   + f"{'host':>8}{'host/seq':>9}")
        for cfg, r in rows.items():
            ms = r["ms_per_round"]
            if not ms:  # no scheduler rounds (the llama_cpp reference loop)
                continue
            out.append(f"{cfg:<34}" + "".join(f"{_ms(ms.get(k), 3):>{max(9, len(k) + 2)}}" for k in stages)
                       + f"{_ms(r['host_ms_per_round'], 3):>8}{_ms(r['host_ms_per_seq_round'], 3):>9}")
            if r["speculator_ms_per_ask"]:
                out.append(f"{'':<34}look-up ms per sequence asked: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r["speculator_ms_per_ask"].items()))
        return out

    def rollback_lines(self, js: dict) -> list[str]:
        """A recurrent target's rollbacks (overall): the share of drafted verifies rolled back, and per round the
        state saves, restores and replayed rows with their milliseconds; sequences failed, if any."""
        rows = {cfg: js["configs"][cfg]["overall"] for cfg in self.configs}
        if not any(r["rollback"]["verifies"] or r["failed_sequences"] for r in rows.values()):
            return []
        out = ["\n== state rollback (recurrent target, overall): share of drafted verifies rolled back; per round: "
               "saves, restores, replayed rows, and their ms ==",
               f"{'config':<34}{'rolled':>8}{'saves':>7}{'save_ms':>9}{'restores':>9}{'rest_ms':>9}{'replay':>8}"
               f"{'repl_ms':>9}{'failed':>8}"]
        for cfg, r in rows.items():
            b = r["rollback"]
            if not b["verifies"] and not r["failed_sequences"]:
                continue
            out.append(f"{cfg:<34}{b['rolled_back_share']:>8.2f}{b['saves_per_round']:>7.2f}{b['save_ms_per_round']:>9.3f}"
                       f"{b['restores_per_round']:>9.2f}{b['restore_ms_per_round']:>9.3f}"
                       f"{b['replay_rows_per_round']:>8.2f}{b['replay_ms_per_round']:>9.3f}{r['failed_sequences']:>8}")
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

    def skip_lines(self) -> list[str]:
        """A line naming the prompts left out as too long for a sequence's context (bench/fit.py)."""
        skipped = self.meta.get("skipped") or []
        if not skipped:
            return []
        names = ", ".join(s["prompt"] for s in skipped[:12]) + (f" and {len(skipped) - 12} more"
                                                                   if len(skipped) > 12 else "")
        return [f"\nskipped {len(skipped)} prompt{'s' if len(skipped) > 1 else ''} too long for "
                f"{self.meta['n_ctx_seq']} cells per sequence ({names}); --n-ctx "
                f"{self.meta['n_ctx_fitting_all']} fits them all"]


def rollback_row(b: dict, rounds: int) -> dict:
    """Per-round figures of summed RollbackStats counters.

    >>> r = rollback_row({"verifies": 10, "rollbacks": 4, "saves": 10, "save_seconds": 0.002, "restores": 4,
    ...                   "restore_seconds": 0.001, "replay_rows": 8, "replay_seconds": 0.004}, rounds=20)
    >>> r["rolled_back_share"], r["saves_per_round"], r["save_ms_per_round"], r["replay_rows_per_round"]
    (0.4, 0.5, 0.1, 0.4)
    """
    n = max(1, rounds)
    v = b.get("verifies", 0)
    return {"verifies": v, "rolled_back_share": b.get("rollbacks", 0) / v if v else 0.0,
            "saves_per_round": b.get("saves", 0) / n, "save_ms_per_round": 1e3 * b.get("save_seconds", 0.0) / n,
            "restores_per_round": b.get("restores", 0) / n,
            "restore_ms_per_round": 1e3 * b.get("restore_seconds", 0.0) / n,
            "replay_rows_per_round": b.get("replay_rows", 0) / n,
            "replay_ms_per_round": 1e3 * b.get("replay_seconds", 0.0) / n}


def _ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _share(v: float) -> str:
    """A share as a whole percentage, '-' for none.

    >>> _share(0.0), _share(0.416)
    ('-', '42%')
    """
    return f"{100 * v:.0f}%" if v else "-"



def write_json(report: BenchReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)


def print_report(text: str, report: dict, json_path: str | None) -> int:
    """Print a bench's table; with json_path, write its JSON there too and say so. Returns 0 (the exit code)."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {json_path}")
    return 0

