"""`specray ab-report`: compare A/B arms from a server's /v1/stats, with bootstrap confidence intervals.

Input: the `arms` block of GET /v1/stats (live, `--url`, or saved, `--from`):
per arm, per-request records (completion tokens, TTFT, mean inter-token
latency, drafts, drafted and accepted tokens). Per arm the report gives:

- requests (records available / total served),
- tokens/s per request: the mean over requests of 1 / ITL (decode speed after
  the first token; requests with fewer than 2 tokens have none),
- mean acceptance length 1 + sum(accepted) / sum(drafts) and acceptance rate
  sum(accepted) / sum(drafted) (ratio estimators over the arm's requests),
- TTFT and ITL percentiles (p50, p90, p99),

each with a 95% percentile-bootstrap interval (requests resampled with
replacement; `n_boot` resamples, fixed seed). A winner (on tokens/s per
request) is named only when its interval lies entirely above every other
arm's; the speedup of each arm over the baseline (the `none` arm if there is
one, else the first) is the ratio of means with its own bootstrap interval.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import numpy as np

ALPHA = 0.05
PERCENTILES = (50, 90, 99)
#: bootstrap work is chunked so memory stays bounded (resamples x requests index matrix)
_MAX_CELLS = 4_000_000


@dataclass
class Estimate:
    value: float | None
    lo: float | None = None
    hi: float | None = None

    def to_dict(self) -> dict:
        return {"value": self.value, "ci95": [self.lo, self.hi]}

    def fmt(self, scale: float = 1.0, digits: int = 1) -> str:
        if self.value is None:
            return "-"
        v = f"{self.value * scale:.{digits}f}"
        if self.lo is None:
            return v
        return f"{v} [{self.lo * scale:.{digits}f}, {self.hi * scale:.{digits}f}]"


@dataclass
class ArmReport:
    name: str
    chain: str
    requests: int  # records used
    served: int  # requests the arm served in all (records may be capped)
    errors: int
    tokens_per_s: Estimate
    mean_acceptance_length: Estimate
    acceptance_rate: Estimate
    ttft: dict[int, Estimate] = field(default_factory=dict)  # percentile -> seconds
    itl: dict[int, Estimate] = field(default_factory=dict)
    speedup: Estimate | None = None  # tokens/s per request vs the baseline arm
    tps_samples: np.ndarray | None = None  # per-request tokens/s (for the plot)

    def to_dict(self) -> dict:
        return {"name": self.name, "chain": self.chain, "requests": self.requests, "served": self.served,
                "errors": self.errors, "tokens_per_s": self.tokens_per_s.to_dict(),
                "mean_acceptance_length": self.mean_acceptance_length.to_dict(),
                "acceptance_rate": self.acceptance_rate.to_dict(),
                "ttft_s": {f"p{p}": e.to_dict() for p, e in self.ttft.items()},
                "itl_s": {f"p{p}": e.to_dict() for p, e in self.itl.items()},
                "speedup": self.speedup.to_dict() if self.speedup else None}


# ---- bootstrap --------------------------------------------------------------------------------
def _resample_chunks(n: int, n_boot: int, rng: np.random.Generator):
    rows = max(1, _MAX_CELLS // max(n, 1))
    done = 0
    while done < n_boot:
        k = min(rows, n_boot - done)
        yield rng.integers(0, n, size=(k, n))
        done += k


def bootstrap(stat, arrays: tuple[np.ndarray, ...], n_boot: int = 2000, seed: int = 0,
              alpha: float = ALPHA) -> Estimate:
    """Point estimate and percentile-bootstrap interval of `stat(*arrays_resampled)`, where stat maps
    arrays of shape (k, n) (k resamples of the n requests) to k values; arrays share their request axis."""
    n = len(arrays[0])
    if n == 0:
        return Estimate(None)
    point = float(stat(*(a[None, :] for a in arrays))[0])
    if n == 1 or n_boot <= 0:
        return Estimate(point)
    rng = np.random.default_rng(seed)
    vals = np.concatenate([stat(*(a[idx] for a in arrays)) for idx in _resample_chunks(n, n_boot, rng)])
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return Estimate(point)
    lo, hi = np.quantile(vals, [alpha / 2, 1 - alpha / 2])
    return Estimate(point, float(lo), float(hi))


def _mean(x):
    return x.mean(axis=1)


def _ratio(num, den):
    s = den.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s > 0, num.sum(axis=1) / np.where(s > 0, s, 1), np.nan)


def _mal(accepted, drafts):
    r = _ratio(accepted, drafts)
    return np.where(np.isnan(r), 1.0, 1.0 + r)  # no drafts at all: every round yields one token


def _pct(q):
    return lambda x: np.percentile(x, q, axis=1)


def ratio_of_means(a: np.ndarray, b: np.ndarray, n_boot: int = 2000, seed: int = 0,
                   alpha: float = ALPHA) -> Estimate:
    """mean(a) / mean(b) for two independent samples, with a bootstrap interval (each resampled alone)."""
    if not len(a) or not len(b) or b.mean() == 0:
        return Estimate(None)
    point = float(a.mean() / b.mean())
    if len(a) < 2 or len(b) < 2 or n_boot <= 0:
        return Estimate(point)
    rng = np.random.default_rng(seed)
    ma = np.concatenate([a[i].mean(axis=1) for i in _resample_chunks(len(a), n_boot, rng)])
    mb = np.concatenate([b[i].mean(axis=1) for i in _resample_chunks(len(b), n_boot, rng)])
    lo, hi = np.quantile(ma / mb, [alpha / 2, 1 - alpha / 2])
    return Estimate(point, float(lo), float(hi))


# ---- from /v1/stats to a report ---------------------------------------------------------------
def _col(records: dict, name: str) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in records.get(name, [])], dtype=np.float64)


def arm_report(name: str, arm: dict, n_boot: int = 2000, seed: int = 0) -> ArmReport:
    rec = arm.get("records") or {}
    itl = _col(rec, "itl_s")
    ttft = _col(rec, "ttft_s")
    drafts, drafted, accepted = _col(rec, "drafts"), _col(rec, "drafted"), _col(rec, "accepted")
    tps = 1.0 / itl[np.isfinite(itl) & (itl > 0)]
    itl_ok = itl[np.isfinite(itl)]
    ttft_ok = ttft[np.isfinite(ttft)]
    n = len(_col(rec, "completion_tokens"))
    return ArmReport(
        name=name, chain=str(arm.get("chain", "?")), requests=n, served=int(arm.get("requests", n)),
        errors=int(arm.get("errors", 0)),
        tokens_per_s=bootstrap(_mean, (tps,), n_boot, seed),
        mean_acceptance_length=bootstrap(_mal, (accepted, drafts), n_boot, seed),
        acceptance_rate=(bootstrap(_ratio, (accepted, drafted), n_boot, seed) if np.nansum(drafted) > 0
                         else Estimate(None)),
        ttft={q: bootstrap(_pct(q), (ttft_ok,), n_boot, seed) for q in PERCENTILES},
        itl={q: bootstrap(_pct(q), (itl_ok,), n_boot, seed) for q in PERCENTILES},
        tps_samples=tps,
    )


def separated_winner(estimates: dict[str, Estimate]) -> str | None:
    """The arm whose interval lies strictly above every other arm's, or None (overlap, or too little data)."""
    ok = {k: e for k, e in estimates.items() if e.value is not None and e.lo is not None}
    if len(ok) < 2 or len(ok) < len(estimates):
        return None
    best = max(ok, key=lambda k: ok[k].value)
    if all(ok[best].lo > e.hi for k, e in ok.items() if k != best):
        return best
    return None


def baseline_arm(arms: dict[str, dict]) -> str:
    for name, a in arms.items():
        if a.get("chain") == "none":
            return name
    return next(iter(arms))


@dataclass
class Report:
    arms: list[ArmReport]
    baseline: str
    winner: str | None
    source: str = ""

    def to_dict(self) -> dict:
        return {"source": self.source, "baseline": self.baseline, "winner": self.winner,
                "metric": "tokens_per_s", "arms": [a.to_dict() for a in self.arms]}


def model_stats(stats: dict, model: str | None) -> tuple[dict, str]:
    """The /v1/stats part that holds `model`'s arms ({"arms": ...}), and its name for the report's title.
    A multi-model server lists each model under `models` (with its aliases); without --model the report is the
    default model's (the top-level `arms`). ValueError naming the models for one the server does not serve.

    >>> st = {"arms": {"a": {}}, "models": {"smol": {"arms": {"a": {}}, "aliases": ["s"], "default": True},
    ...                                     "gemma": {"arms": {"b": {}}, "aliases": [], "default": False}}}
    >>> model_stats(st, "gemma")[0]["arms"], model_stats(st, "s")[1], model_stats(st, None)[1]
    ({'b': {}}, 'smol', 'smol')
    """
    models = stats.get("models")
    if not models:
        if model is not None:
            raise ValueError(f"--model {model!r}: this server serves one model (no `models` in its /v1/stats); "
                             "leave --model out")
        return stats, ""
    if model is None:
        return stats, next((m for m, b in models.items() if b.get("default")), "")
    for mid, block in models.items():
        if model == mid or model in block.get("aliases", []):
            return block, mid
    raise ValueError(f"--model {model!r}: not a model of this server; it serves {', '.join(models)}")


def build_report(stats: dict, n_boot: int = 2000, seed: int = 0, source: str = "") -> Report:
    arms = stats.get("arms")
    if not arms:
        raise ValueError(f"{source or 'stats'}: no `arms` block (is this a specray /v1/stats answer?)")
    reports = [arm_report(name, a, n_boot, seed) for name, a in arms.items()]
    base = baseline_arm(arms)
    by_name = {r.name: r for r in reports}
    for r in reports:
        r.speedup = ratio_of_means(r.tps_samples, by_name[base].tps_samples, n_boot, seed)
    winner = separated_winner({r.name: r.tokens_per_s for r in reports})
    return Report(reports, base, winner, source)


# ---- output -------------------------------------------------------------------------------------
def format_report(rep: Report) -> str:
    cols = ["arm", "chain", "requests", "tok/s per request", "mean acc. length", "acc. rate",
            "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "speedup"]
    rows = []
    for a in rep.arms:
        served = f"{a.requests}" if a.served == a.requests else f"{a.requests}/{a.served}"
        if a.errors:
            served += f" (+{a.errors} err)"
        rows.append([a.name, a.chain, served, a.tokens_per_s.fmt(), a.mean_acceptance_length.fmt(digits=2),
                     a.acceptance_rate.fmt(digits=2), a.ttft[50].fmt(1e3), a.ttft[90].fmt(1e3), a.itl[50].fmt(1e3),
                     a.itl[90].fmt(1e3), "baseline" if a.name == rep.baseline else
                     (a.speedup.fmt(digits=2) + "x" if a.speedup and a.speedup.value is not None else "-")])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = [f"specray ab-report{' — ' + rep.source if rep.source else ''}: {len(rep.arms)} arms, "
           f"{sum(a.requests for a in rep.arms)} requests; values [95% bootstrap CI]"]
    out.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    p99 = "; ".join(f"{a.name} TTFT {a.ttft[99].fmt(1e3, 0)} ms, ITL {a.itl[99].fmt(1e3)} ms" for a in rep.arms)
    out.append(f"p99: {p99}")
    if rep.winner:
        w = next(a for a in rep.arms if a.name == rep.winner)
        sp = f", {w.speedup.fmt(digits=2)}x vs {rep.baseline}" if w.speedup and w.name != rep.baseline else ""
        out.append(f"winner: {rep.winner} (tokens/s per request: its 95% interval lies above every other arm's{sp})")
    else:
        out.append("no winner: the 95% intervals of tokens/s per request overlap (or an arm has too few "
                   "requests); collect more traffic")
    return "\n".join(out)


def plot_report(rep: Report, path: str) -> None:
    """A 2x2 figure: tokens/s per request (distribution + mean CI), acceptance length, TTFT and ITL
    percentiles, each arm in its own colour, the winner in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [a.name for a in rep.arms]
    colors = [f"C{i}" for i in range(len(names))]
    x = np.arange(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))

    def bars(ax, ests: list[Estimate], scale: float, ylabel: str, title: str, offset: float = 0.0,
             width: float = 0.6, label: str | None = None, hatch: str | None = None):
        vals = [(e.value or 0) * scale for e in ests]
        err = [[max(0.0, (e.value - e.lo) * scale) if e.lo is not None else 0 for e in ests],
               [max(0.0, (e.hi - e.value) * scale) if e.hi is not None else 0 for e in ests]]
        ax.bar(x + offset, vals, width, yerr=err, capsize=5, color=colors, alpha=0.8, label=label, hatch=hatch,
               edgecolor="black", linewidth=0.5)
        ax.set_xticks(x, names)
        ax.set_ylabel(ylabel)
        ax.set_title(title)

    ax = axes[0, 0]
    samples = [a.tps_samples if a.tps_samples is not None and len(a.tps_samples) else np.zeros(1) for a in rep.arms]
    parts = ax.violinplot(samples, positions=x, showmeans=False, showextrema=False)
    for body, c in zip(parts["bodies"], colors):
        body.set_facecolor(c)
        body.set_alpha(0.3)
    for i, a in enumerate(rep.arms):
        e = a.tokens_per_s
        if e.value is not None:
            ax.errorbar([i], [e.value], yerr=[[e.value - (e.lo or e.value)], [(e.hi or e.value) - e.value]],
                        fmt="o", color="black", capsize=6)
    ax.set_xticks(x, names)
    ax.set_ylabel("tokens/s per request")
    ax.set_title("decode speed per request (mean, 95% CI)")
    bars(axes[0, 1], [a.mean_acceptance_length for a in rep.arms], 1.0, "tokens per verify",
         "mean acceptance length (95% CI)")
    for ax, key, title in ((axes[1, 0], "ttft", "time to first token"), (axes[1, 1], "itl", "inter-token latency")):
        bars(ax, [getattr(a, key)[50] for a in rep.arms], 1e3, "ms", f"{title}: p50 (solid), p90 (hatched)",
             offset=-0.2, width=0.38)
        bars(ax, [getattr(a, key)[90] for a in rep.arms], 1e3, "ms", f"{title}: p50 (solid), p90 (hatched)",
             offset=0.2, width=0.38, hatch="//")
    verdict = (f"winner: {rep.winner}" if rep.winner else "no winner (intervals overlap)")
    fig.suptitle(f"specray A/B: {', '.join(f'{a.name}={a.chain}' for a in rep.arms)} — {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_stats(url: str | None = None, path: str | None = None, api_key: str | None = None,
               timeout: float = 60) -> tuple[dict, str]:
    if path:
        with open(path) as f:
            return json.load(f), path
    from specray.bench.http_client import get_json

    return get_json(url, "/v1/stats", api_key, timeout), url


def main_ab_report(args) -> int:
    import os

    if bool(args.url) == bool(args.from_file):
        raise ValueError("give one of --url (a running server) or --from (a saved /v1/stats JSON)")
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    stats, source = load_stats(args.url, args.from_file, api_key)
    if args.save_stats:
        with open(args.save_stats, "w") as f:
            json.dump(stats, f)
    part, model = model_stats(stats, getattr(args, "model", None))
    rep = build_report(part, n_boot=args.bootstrap, seed=args.seed, source=f"{source}, model {model}" if model
                       else source)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.to_dict(), f, indent=2)
    if args.plot:
        plot_report(rep, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
