"""Several models under load at once, over HTTP: `specray bench --url URL --models ID [ID ...]`.

A *setup* is a list of models, each with the URL that serves it (`ID` alone: the first --url; `ID@URL`: its
own server). Every model of a setup gets `--concurrency` client threads of its own, all started together, each
streaming prompts with `"model": ID`; per model: requests, errors, output tokens/s over the setup's wall time,
TTFT and per-request decode speed. Several --models flags are several setups, run in turn and repeated
`--repeats` times in alternating order, so a two-model app and two one-model apps are compared on the same
machine in the same minutes:

    specray bench --url http://127.0.0.1:8000/multi --models smol gemma \\
        --models smol@http://127.0.0.1:8000/smol gemma@http://127.0.0.1:8000/gemma --concurrency 4 --repeats 2
"""

from __future__ import annotations

import threading
import time

from specray.bench.http_client import run

#: client threads per model (--concurrency)
DEFAULT_CONCURRENCY = 4


def parse_setup(entries: list[str], default_url: str | None) -> list[tuple[str, str]]:
    """`ID` / `ID@URL` entries -> [(model id, url)]; ValueError naming a bad entry.

    >>> parse_setup(["smol", "gemma@http://h:2/g"], "http://h:1")
    [('smol', 'http://h:1'), ('gemma', 'http://h:2/g')]
    """
    out = []
    for e in entries:
        model, _, url = e.partition("@")
        url = url or default_url
        if not model or not url:
            raise ValueError(f"--models {e!r}: expected ID or ID@URL (ID alone needs --url)")
        out.append((model, url.rstrip("/")))
    return out


def setup_label(setup: list[tuple[str, str]]) -> str:
    """'one app' when every model shares a URL, else 'N apps'.

    >>> setup_label([("a", "u"), ("b", "u")]), setup_label([("a", "u"), ("b", "v")])
    ('one app', '2 apps')
    """
    urls = {u for _, u in setup}
    return "one app" if len(urls) == 1 else f"{len(urls)} apps"


def run_setup(setup: list[tuple[str, str]], prompts: list[dict], concurrency: int, max_tokens: int,
              api_key: str | None, timeout: float) -> dict:
    """Every model's clients at once; {model: http_client.run's figures} and the wall time of the whole."""
    results: dict[str, dict] = {}

    def one(model: str, url: str) -> None:
        results[model] = run(url, prompts, concurrency, max_tokens, {"model": model}, timeout, api_key)

    threads = [threading.Thread(target=one, args=m, daemon=True) for m in setup]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": round(time.perf_counter() - t0, 3), "models": {m: results[m] for m, _ in setup}}


def report_text(report: dict) -> str:
    """One row per setup, repeat and model; then each setup's tok/s per model summed over repeats, as a ratio
    to the first setup's.

    >>> row = lambda tps: {"requests": 4, "n_errors": 0, "tokens_per_s": tps, "mean_ttft_ms": 200.0,
    ...                    "mean_acceptance_length": 1.5}
    >>> rep = {"meta": {"concurrency": 2, "max_tokens": 8, "prompts": 4},
    ...        "runs": [{"setup": "one app", "repeat": 0, "wall_s": 3.0, "models": {"a": row(20.0)}},
    ...                 {"setup": "2 apps", "repeat": 0, "wall_s": 3.1, "models": {"a": row(19.0)}}],
    ...        "summary": {"one app": {"a": 20.0}, "2 apps": {"a": 19.0}}}
    >>> print(report_text(rep))  # doctest: +NORMALIZE_WHITESPACE
    models under load at once: 2 clients per model, 4 prompts each, 8 tokens per answer
    setup  repeat  model  req  err  wall s  tok/s  mean TTFT ms  acc. length
    one app     0      a    4    0    3.00   20.0         200.0         1.50
     2 apps     0      a    4    0    3.10   19.0         200.0         1.50
    tok/s per model vs one app: 2 apps a 0.95x
    """
    m = report["meta"]
    lines = [f"models under load at once: {m['concurrency']} clients per model, {m['prompts']} prompts each, "
             f"{m['max_tokens']} tokens per answer"]
    rows = [["setup", "repeat", "model", "req", "err", "wall s", "tok/s", "mean TTFT ms", "acc. length"]]
    for r in report["runs"]:
        for model, f in r["models"].items():
            ttft, acc = f.get("mean_ttft_ms"), f.get("mean_acceptance_length")
            rows.append([r["setup"], str(r["repeat"]), model, str(f["requests"]), str(f["n_errors"]),
                         f"{r['wall_s']:.2f}", f"{f['tokens_per_s'] or 0:.1f}",
                         "-" if ttft is None else f"{ttft:.1f}", "-" if acc is None else f"{acc:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    setups = list(report["summary"])
    if len(setups) > 1:
        base = report["summary"][setups[0]]
        parts = [f"{s} " + ", ".join(f"{mod} {tps / base[mod]:.2f}x" for mod, tps in report["summary"][s].items()
                                     if base.get(mod)) for s in setups[1:]]
        lines.append(f"tok/s per model vs {setups[0]}: " + "; ".join(parts))
    return "\n".join(lines)


def main_multi_model(args) -> int:
    """`specray bench [--url URL] --models ID[@URL] ... [--models ...] [--concurrency C] [--repeats R]`."""
    import os
    import sys

    from specray.bench.http_compare import select_prompts
    from specray.bench.prompts import default_prompts_path
    from specray.bench.report import print_report

    default_url = args.url[0] if args.url else None
    setups = [parse_setup(entries, default_url) for entries in args.models]
    labels = [setup_label(s) for s in setups]
    labels = [lab if labels.count(lab) == 1 else f"{lab} #{i + 1}" for i, lab in enumerate(labels)]
    concurrency = args.concurrency or DEFAULT_CONCURRENCY
    path = args.prompts or default_prompts_path()
    cats = args.categories.split(",") if args.categories else None
    prompts = select_prompts(path, cats, args.per_category, args.num_prompts or 4 * concurrency)
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    for setup in setups:  # warm-up: each model answers once before anything is timed
        run_setup(setup, prompts[:1], 1, 4, api_key, args.timeout)
    runs, totals = [], {lab: {} for lab in labels}
    for rep in range(args.repeats):
        order = list(zip(labels, setups))
        for label, setup in order if rep % 2 == 0 else order[::-1]:
            print(f"{label}, repeat {rep}: {', '.join(f'{m}@{u}' for m, u in setup)}", file=sys.stderr, flush=True)
            res = run_setup(setup, prompts, concurrency, args.max_tokens, api_key, args.timeout)
            runs.append({"setup": label, "repeat": rep} | res)
            for model, f in res["models"].items():
                totals[label].setdefault(model, []).append(f["tokens_per_s"] or 0.0)
    summary = {lab: {m: round(sum(v) / len(v), 2) for m, v in per.items()} for lab, per in totals.items()}
    report = {"kind": "specray-multi-model-bench", "runs": runs, "summary": summary,
              "meta": {"setups": [{"label": lab, "models": s} for lab, s in zip(labels, setups)],
                       "concurrency": concurrency, "max_tokens": args.max_tokens, "prompts": len(prompts),
                       "prompts_path": path, "repeats": args.repeats, "cpus": os.cpu_count(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}}
    return print_report(report_text(report), report, args.json)
