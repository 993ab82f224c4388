"""`specray bench --plot FILE.png`: speedup over `none` by category and configuration, with the spread over
--repeats passes as whiskers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .report import BenchReport


@dataclass(frozen=True)
class Bar:
    category: str  # a category, or "overall"
    config: str
    speedup: float  # tokens/s over `none`'s, all passes summed (the table's `speedup`)
    lo: float | None = None  # the slowest and fastest single pass (the table's `range`); None with one pass
    hi: float | None = None


def speedup_bars(report: BenchReport) -> list[Bar]:
    """The bars of the plot, category by category (then "overall", if there are several categories), every
    configuration but `none` in each: the same figures as the table.

    >>> from specray.bench.report import ConfigResult
    >>> def ran(name, tok_s):
    ...     return ConfigResult(name, tokens=100, seconds=100 / tok_s, loaded_tokens=100, loaded_seconds=100 / tok_s)
    >>> rep = BenchReport(model="m", configs=["none", "suffix"], categories=["qa"])
    >>> rep.results["qa"] = {"none": ran("none", 80.0), "suffix": ran("suffix", 100.0)}
    >>> speedup_bars(rep)
    [Bar(category='qa', config='suffix', speedup=1.25, lo=None, hi=None)]
    """
    if "none" not in report.configs:
        raise ValueError("the plot shows speedups over `none`, and this report has no `none` configuration")
    js = report.to_json()["configs"]
    groups = report.categories + (["overall"] if len(report.categories) > 1 else [])
    out = []
    for cat in groups:
        for cfg in report.configs:
            if cfg == "none":
                continue
            row = js[cfg]["overall"] if cat == "overall" else js[cfg]["categories"][cat]
            if row["speedup"] is None:  # `none` generated nothing here: no ratio to draw
                continue
            passes = row.get("speedup_per_repeat") or []
            lo, hi = (min(passes), max(passes)) if len(passes) > 1 else (None, None)
            out.append(Bar(cat, cfg, row["speedup"], lo, hi))
    return out


def plot_bench(report: BenchReport, path: str) -> list[Bar]:
    """Draw speedup_bars to `path` (PNG): a group of bars per category, one colour per configuration, each
    bar rising from 1.0 (`none`) to its speedup (falling below for a slowdown), its value on top, and with
    several passes a whisker from the slowest to the fastest pass. Returns the bars drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = speedup_bars(report)
    groups = list(dict.fromkeys(b.category for b in bars))
    configs = [c for c in report.configs if c != "none"]
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(min(16.0, max(8.0, 3.2 + 0.3 * len(groups) * len(configs))), 6.0))
    for ci, cfg in enumerate(configs):
        mine = [b for b in bars if b.config == cfg]
        if not mine:
            continue
        x = np.array([groups.index(b.category) for b in mine]) + (ci - (len(configs) - 1) / 2) * width
        sp = np.array([b.speedup for b in mine])
        # bars from 1.0: a gain points up, a loss down, and small differences are not lost on a bar from 0
        ax.bar(x, sp - 1.0, width * 0.92, bottom=1.0, color=f"C{ci % 10}", edgecolor="black", linewidth=0.4,
               label=cfg + (" (reference loop)" if cfg == "llama_cpp" else ""))
        spread = [b for b in mine if b.lo is not None]
        if spread:
            xs = [x[mine.index(b)] for b in spread]
            ax.errorbar(xs, [b.speedup for b in spread],
                        yerr=[[b.speedup - b.lo for b in spread], [b.hi - b.speedup for b in spread]],
                        fmt="none", ecolor="black", elinewidth=1, capsize=3)
        if len(bars) <= 80:  # values stay legible
            for xi, b in zip(x, mine):
                top = max(b.speedup, b.hi or b.speedup) if b.speedup >= 1 else min(b.speedup, b.lo or b.speedup)
                ax.annotate(f"{b.speedup:.2f}", (xi, top), xytext=(0, 3 if b.speedup >= 1 else -3),
                            textcoords="offset points", ha="center", va="bottom" if b.speedup >= 1 else "top",
                            fontsize=7, rotation=90 if len(configs) > 4 else 0)  # narrow bars: upright
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
    ax.text(1.0, 1.0, " none", transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8, color="0.3")
    if "overall" in groups and len(groups) > 1:
        ax.axvline(len(groups) - 1.5, color="0.6", linewidth=0.8)  # the overall group apart from categories
    ax.set_xticks(range(len(groups)), groups, rotation=25 if len(groups) > 5 else 0,
                  ha="right" if len(groups) > 5 else "center")
    lows = [min(b.speedup, b.lo or b.speedup) for b in bars] or [1.0]
    highs = [max(b.speedup, b.hi or b.speedup) for b in bars] or [1.0]
    pad = 0.08 * max(0.1, max(highs) - min(lows))
    ax.set_ylim(min(1.0, min(lows)) - pad, max(1.0, max(highs)) + 2 * pad)
    ax.set_ylabel("speedup over none (tokens/s ratio)")
    passes = max((len(v) for v in report.repeat_results.values()), default=1)
    meta = report.meta
    slots = meta.get("slots")
    setup = ", ".join(s for s in (report.model, f"{slots} slot{'s' if slots != 1 else ''}" if slots else "",
                                  "--exact" if meta.get("exact") else "",
                                  f"{passes} passes (whiskers: slowest to fastest pass)" if passes > 1 else "1 pass")
                      if s)
    ax.set_title(f"specray bench: speedup over none, by category\n{setup}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # off the bars
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bars
