"""`specray bench --url ... | --http`: servers over HTTP against the in-process engine, in one run.

Targets: servers already running (`--url`, labelled by the mode their
/v1/stats reports), or, with `--http`, a local Ray + Serve started here with
one app per mode (`/bench-colocated`, `/bench-distributed`, same engine
config). The in-process LocalEngine (same model, chain, slots) runs the same
prompts too. Per stream count, every target runs in turn (targets interleaved,
so machine drift hits them alike), after one unmeasured warm-up request each.
A row: aggregate tokens/s, its ratio to co-located and to in-process at the
same stream count, the actor hop per round (p50/p95 ms, distributed), rounds
and mean sequences per target decode. Then, per HTTP row, where a request's
time went, stage by stage (bench/stages.py).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import time
from collections import OrderedDict

from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig, parse_chain
from specray.engine.speculators.registry import flag_values

from specray.bench import http_client as http_bench
from specray.cluster.ray_env import environment, quiet_ray_env
from specray.bench.stages import table as stage_table
from specray.bench.report import print_report
from specray.bench.run import default_prompts_path, load_prompts

DEFAULT_STREAMS = [1, 8]
DEFAULT_NUM_PROMPTS = 16
SERVE_MODES = ("colocated", "distributed")
#: ServeConfig.target_hop's and companion_hop's values (--target-hops, --companion-hops)
TARGET_HOPS = ("auto", "actor", "compiled")
LAYOUTS = ("fused", "split")
#: the bar the report checks (`met`): distributed mode's actor hop may cost it at most 15% of colocated
#: mode's throughput at the highest stream count
TARGET_RATIO = 0.85
WARMUP_TOKENS = 8


def select_prompts(path: str, categories: list[str] | None, per_category: int | None, n: int) -> list[dict]:
    """n prompts, taken round-robin over the categories (Spec-Bench is sorted by category)."""
    by_cat: OrderedDict[str, list] = OrderedDict()
    for bp in load_prompts(path, categories, per_category):
        by_cat.setdefault(bp.category, []).append(bp)
    out: list[dict] = []
    while len(out) < n and any(by_cat.values()):
        for items in by_cat.values():
            if items and len(out) < n:
                bp = items.pop(0)
                d = {"messages": bp.messages} if bp.messages is not None else {"prompt": bp.prompt}
                if bp.json_schema is not None:
                    d["json_schema"] = bp.json_schema
                if bp.grammar is not None:
                    d["grammar"] = bp.grammar
                out.append(d)
    return out


def serve_configs(engine: EngineConfig, modes: list[str], layouts: list[str] | None = None,
                  hops: list[str] | None = None, companion_hops: list[str] | None = None):
    """One ServeConfig per mode (and per layout, when several are asked for; and per target hop and companion
    hop of the distributed mode, when `hops` / `companion_hops` name them): same engine, own app name and route
    prefix (one Serve instance). None: ServeConfig's default layout and hops.

    >>> [c.app_name for c in serve_configs(EngineConfig(), ["colocated", "distributed"], hops=["actor", "compiled"])]
    ['specray-bench-colocated', 'specray-bench-distributed-actor', 'specray-bench-distributed-compiled']
    >>> [c.app_name for c in serve_configs(EngineConfig(), ["distributed"], companion_hops=["actor", "compiled"])]
    ['specray-bench-distributed-cactor', 'specray-bench-distributed-ccompiled']
    """
    from specray.deployments.config import ServeConfig

    many = bool(layouts) and len(layouts) > 1
    dist = m_hops = None
    out = []
    for m in modes:
        dist = m == "distributed"
        for lay in layouts or [None]:
            for hop in (hops or [None]) if dist else [None]:
                for m_hops in (companion_hops or [None]) if dist else [None]:
                    name = (m + (f"-{lay}" if many else "") + (f"-{hop}" if hop not in (None, "auto") else "")
                            + (f"-c{m_hops}" if m_hops not in (None, "auto") else ""))
                    extra = (({"layout": lay} if lay else {}) | ({"target_hop": hop} if hop else {})
                             | ({"companion_hop": m_hops} if m_hops else {}))
                    out.append(ServeConfig(engine=engine, mode=m, app_name=f"specray-bench-{name}",
                                           route_prefix=f"/bench-{name}", **extra))
    return out


@contextlib.contextmanager
def deployed(base_url: str, cfgs: list, progress=print):
    """Deploy each config as its own app on the running Serve instance; yields {mode (mode/layout where modes
    repeat): url}; deletes them."""
    from ray import serve

    from specray.deployments.app import build_app_from_config

    urls: dict[str, str] = {}
    try:
        for cfg in cfgs:
            t0 = time.perf_counter()
            serve.run(build_app_from_config(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix)
            key = cfg.app_name.removeprefix("specray-bench-")
            urls[key] = base_url.rstrip("/") + cfg.route_prefix
            progress(f"deployed {key} ({cfg.layout}) at {urls[key]} in {time.perf_counter() - t0:.1f}s")
        yield urls
    finally:
        for cfg in cfgs:
            with contextlib.suppress(Exception):
                serve.delete(cfg.app_name)


def _labels(infos: list[dict]) -> list[str]:
    """Row labels: the server's kind (specray's mode, llama-server, other); with the layout (mode/layout) where
    kinds repeat and the server has one (specray's); with the URL where that still repeats.

    >>> _labels([{"mode": "colocated", "layout": "fused", "url": "u1"}, {"mode": "distributed", "url": "u2"}])
    ['colocated', 'distributed']
    >>> _labels([{"mode": "colocated", "layout": "fused", "url": "u1"}, {"mode": "colocated", "layout": "split",
    ...          "url": "u2"}, {"mode": "colocated", "layout": "split", "url": "u3"}])
    ['colocated/fused', 'colocated/split@u2', 'colocated/split@u3']
    >>> _labels([{"mode": None, "owned_by": "llamacpp", "url": "u1"}, {"mode": "colocated", "url": "u2"}])
    ['llama-server', 'colocated']
    >>> _labels([{"mode": None, "owned_by": "llamacpp", "url": "u1"}, {"mode": None, "owned_by": "llamacpp",
    ...          "url": "u2"}])
    ['llama-server@u1', 'llama-server@u2']
    """
    modes = [http_bench.server_kind(i) for i in infos]
    labels = [f"{m}/{i['layout']}" if modes.count(m) > 1 and i.get("layout") else m for m, i in zip(modes, infos)]
    return [lab if labels.count(lab) == 1 else f"{lab}@{i['url']}" for lab, i in zip(labels, infos)]


def compare(
    urls: list[str],
    prompts: list[dict],
    streams: list[int],
    max_tokens: int,
    engine=None,
    extra: dict | None = None,
    api_key: str | None = None,
    timeout: float = 600,
    progress=print,
) -> dict:
    """Run every target at every stream count; rows with ratios. engine: a LocalEngine or None."""
    from specray.bench.http_local import run_in_process

    infos = [http_bench.describe(u, api_key) for u in urls]
    targets = [{"label": lab} | info for lab, info in zip(_labels(infos), infos)]
    if engine is not None:
        ec = engine.config
        targets.insert(0, {"label": "in-process", "url": None, "mode": "in-process", "model": ec.model,
                           "chain": ec.chain.label, "slots": ec.slots, "n_ctx": ec.n_ctx})
    extra = extra or {}

    def run_one(t: dict, c: int, ps: list[dict], n_tokens: int) -> dict:
        if t["url"] is None:
            return run_in_process(engine, ps, c, n_tokens)
        return http_bench.run(t["url"], ps, c, n_tokens, extra, timeout, api_key)

    for t in targets:  # first requests pay for lazy set-up (handles, connections, allocations)
        w = run_one(t, 1, prompts[:1], min(WARMUP_TOKENS, max_tokens))
        if w["n_errors"]:
            raise RuntimeError(f"{t['label']}: warm-up request failed: {w['errors'][0]}")
    rows = []
    for c in streams:
        for t in targets:
            row = {"label": t["label"]} | run_one(t, c, prompts, max_tokens)
            rows.append(row)
            hop = row.get("hop") or {}
            progress(f"{t['label']:<12} streams {c:>2}: {_f(row['tokens_per_s'], '7.1f')} tok/s"
                     + (f", {row['rounds']} rounds" if row.get("rounds") is not None else "")
                     + (f", hop p50 {hop['p50_ms']} ms" if hop.get("p50_ms") is not None else "")
                     + (f", {row['n_errors']} errors" if row["n_errors"] else ""))
    for c in streams:
        same = [r for r in rows if r["streams"] == c]
        colo = next((r for r in same if r["mode"] == "colocated"), None)
        local = next((r for r in same if r["mode"] == "in-process"), None)
        for r in same:
            r["vs_colocated"] = _ratio(r, colo)
            r["vs_in_process"] = _ratio(r, local)
    return {"kind": "specray-http-bench", "targets": targets, "rows": rows, "summary": summarize(rows, streams)}


def _ratio(row: dict, base: dict | None) -> float | None:
    if base is None or not base.get("tokens_per_s") or row.get("tokens_per_s") is None:
        return None
    return round(row["tokens_per_s"] / base["tokens_per_s"], 3)


def summarize(rows: list[dict], streams: list[int]) -> dict:
    ratios = {}
    for c in streams:
        dist = next((r for r in rows if r["streams"] == c and r["mode"] == "distributed"), None)
        ratios[str(c)] = dist["vs_colocated"] if dist else None
    top = str(max(streams))
    return {"distributed_vs_colocated": ratios, "target_ratio": TARGET_RATIO, "at_streams": int(top),
            "met": None if ratios.get(top) is None else ratios[top] >= TARGET_RATIO}


def _f(v, fmt: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


#: the table's columns: header, width, value(row), format; a column no row has a value for is left out
#: (a server without /v1/stats has no rounds, hop or decode figures, one without `speculative` no acc_len)
COLUMNS = [
    ("streams", 8, lambda r: r["streams"], "d"),
    ("tok/s", 9, lambda r: r["tokens_per_s"], ".1f"),
    ("vs colo", 9, lambda r: r.get("vs_colocated"), ".2fx"),
    ("vs in-proc", 11, lambda r: r.get("vs_in_process"), ".2fx"),
    ("hop p50", 9, lambda r: (r.get("hop") or {}).get("p50_ms"), ".2f"),
    ("hop p95", 9, lambda r: (r.get("hop") or {}).get("p95_ms"), ".2f"),
    ("rounds", 8, lambda r: r.get("rounds"), "d"),
    ("round ms", 9, lambda r: r.get("round_ms"), ".1f"),
    ("draft", 7, lambda r: r.get("draft_ms_per_round"), ".1f"),
    ("verify", 7, lambda r: r.get("target_ms_per_round"), ".1f"),
    ("host", 7, lambda r: r.get("host_ms_per_round"), ".2f"),
    ("seqs/dec", 9, lambda r: r.get("mean_seqs_per_decode"), ".2f"),
    ("acc_len", 8, lambda r: r.get("mean_acceptance_length"), ".2f"),
    ("dec cpu", 8, lambda r: (r.get("server_cpu") or {}).get("decode_ms_per_token"), ".2f"),
    ("srv cpu", 8, lambda r: (r.get("server_cpu") or {}).get("other_ms_per_token"), ".2f"),
    ("ray cpu", 8, lambda r: (r.get("server_cpu") or {}).get("ray_ms_per_token"), ".2f"),
    ("ttft ms", 9, lambda r: r.get("mean_ttft_ms"), ".0f"),
    ("errors", 7, lambda r: r["n_errors"], "d"),
]


def _cell(v, fmt: str) -> str:
    return _f(v, fmt[:-1], "x") if fmt.endswith("x") else _f(v, fmt)


def table(report: dict) -> str:
    m = report.get("meta", {})
    lines = []
    if m:
        chain = m.get("chain") or "the server's own"  # None: a server that does not say (llama-server)
        slots = f", slots {m['slots']}" if m.get("slots") else ""
        lines.append(f"HTTP bench: {m.get('model')}, chain {chain}, {m.get('prompts')} prompts x "
                     f"{m.get('max_tokens')} max tokens{slots}")
    rows = report["rows"]
    cols = [c for c in COLUMNS if any(c[2](r) is not None for r in rows)]
    width = max([14] + [len(r["label"]) + 2 for r in rows])
    lines.append(f"{'mode':<{width}}" + "".join(f"{h:>{w}}" for h, w, _, _ in cols))
    for r in rows:
        lines.append(f"{r['label']:<{width}}" + "".join(f"{_cell(get(r), fmt):>{w}}" for _, w, get, fmt in cols))
    s = report["summary"]
    parts = [f"{c} stream{'s' if c != '1' else ''} {_f(v, '.2f', 'x')}"
             for c, v in s["distributed_vs_colocated"].items()]
    verdict = "n/a" if s["met"] is None else ("met" if s["met"] else "NOT met")
    lines.append(f"distributed vs colocated: {', '.join(parts)}  (target >= {s['target_ratio']}x at "
                 f"{s['at_streams']} streams: {verdict}); hop = router-side wall time of the target call minus "
                 "the actor's own time, ms; round/draft/verify = ms per round: the whole round, the speculators' "
                 "drafting (companion call included), the target's own decode time"
                 + ("; dec cpu / srv cpu = CPU ms per generated token of the server's processes on this machine: "
                    "llama.cpp's decode threads / every other thread; ray cpu: Ray's own processes beside them "
                    "(GCS, raylet, dashboard, log monitor, Serve controller and proxy; bench/server_cpu.py)"
                    if any(r.get("server_cpu") for r in rows) else ""))
    for r in report["rows"]:
        if r.get("stages"):
            lines.append("")
            lines.append(stage_table(r["label"], r["streams"], r["stages"]))
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(port: int = 0, progress=print, apps: int = 1):
    """A fresh local Ray + Serve on 127.0.0.1:port (0 = a free port); yields the base URL; shuts both down.
    `apps`: how many apps will be deployed at once. Each reserves its CPUs (its placement group, in distributed
    mode) though only one is loaded at a time, so Ray is told of that many times the cores: four apps on a
    2-core box otherwise wait forever for a placement group that cannot fit."""
    import ray
    from ray import serve

    port = port or _free_port()
    t0 = time.perf_counter()
    # address="local": always a new cluster, even when RAY_ADDRESS points at one; Ray's own processes as
    # quiet as specray serve starts them (cluster/ray_env.py), so the served rows pay what they would there
    with environment(quiet_ray_env(os.environ)):
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2) * max(1, apps), include_dashboard=False,
                 logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        progress(f"local Ray + Serve on port {port} in {time.perf_counter() - t0:.1f}s")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def engine_config(args, slots: int, chain_label: str | None) -> EngineConfig:
    chain = ChainConfig(policy=args.policy, n_max=args.n_max)
    if chain_label is not None:
        chain = chain.model_copy(update={"speculators": parse_chain(chain_label)})
    extra = {}
    if getattr(args, "draft_model", None):  # the `draft` speculator's model and its --draft-<option> flags
        from specray.engine.config import DraftModelConfig

        extra["draft"] = DraftModelConfig.from_flags(args)
    hidden = HiddenStateConfig(**flag_values(args, "hidden"))
    if hidden.enabled:  # the hidden-state heads (--mtp, --eagle3-model, --dflash-model), as the in-process bench
        extra["hidden"] = hidden
    return EngineConfig(model=args.model, chat_template=args.chat_template, n_ctx=args.n_ctx, slots=slots,
                        threads=args.threads, exact=args.exact, flash_attn=getattr(args, "flash_attn", None),
                        chain=chain, prompt_cache=False, **extra)


def main_http_bench(args) -> int:
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    streams = list(dict.fromkeys(args.streams or DEFAULT_STREAMS))
    categories = [c for c in (args.categories or "").split(",") if c] or None
    prompts_path = args.prompts or default_prompts_path()
    prompts = select_prompts(prompts_path, categories, args.per_category, args.num_prompts or DEFAULT_NUM_PROMPTS)
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    meta = {"prompts": len(prompts), "prompts_path": prompts_path, "max_tokens": args.max_tokens,
            "streams": streams, "policy": args.policy, "n_max": args.n_max, "threads": args.threads,
            "exact": args.exact, "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}

    def finish(report: dict, ecfg: EngineConfig, served: dict | None = None) -> int:
        """served: where no in-process engine ran, what the first --url server says about itself; the header
        then names its model, chain and slots, not those of an engine config nothing loaded (a llama-server's
        chain is unknown: None)."""
        if served is None:
            about = {"model": ecfg.model, "chain": ecfg.chain.label, "slots": ecfg.slots,
                     "flash_attn": ecfg.flash_attn_on, "n_ctx": ecfg.n_ctx}
        else:
            chain = (args.spec or served["chain"]) if served.get("owned_by") == "specray" else served["chain"]
            about = {"model": served["model"], "chain": chain, "slots": served["slots"], "flash_attn": None,
                     "n_ctx": served["n_ctx"]}
        report["meta"] = meta | about
        return print_report(table(report), report, args.json)

    def local_engine(ecfg: EngineConfig):
        if args.no_in_process:
            return None
        from specray.deployments.local_engine import LocalEngine

        return LocalEngine(ecfg)

    if args.http:
        modes = [m for m in (args.serve_modes or ",".join(SERVE_MODES)).split(",") if m]
        bad = [m for m in modes if m not in SERVE_MODES]
        if bad or not modes:
            raise ValueError(f"--serve-modes: expected a comma-separated subset of {','.join(SERVE_MODES)}, "
                             f"got {args.serve_modes!r}")
        layouts = [x for x in (args.layouts or "").split(",") if x] or None
        if layouts and any(x not in LAYOUTS for x in layouts):
            raise ValueError(f"--layouts: expected a comma-separated subset of {','.join(LAYOUTS)}, got "
                             f"{args.layouts!r}")
        ecfg = engine_config(args, args.slots or max(streams), args.spec)
        hops = [x for x in (args.target_hops or "").split(",") if x] or None
        if hops and any(x not in TARGET_HOPS for x in hops):
            raise ValueError(f"--target-hops: expected a comma-separated subset of {','.join(TARGET_HOPS)}, got "
                             f"{args.target_hops!r}")
        c_hops = [x for x in (args.companion_hops or "").split(",") if x] or None
        if c_hops and any(x not in TARGET_HOPS for x in c_hops):
            raise ValueError(f"--companion-hops: expected a comma-separated subset of {','.join(TARGET_HOPS)}, got "
                             f"{args.companion_hops!r}")
        configs = serve_configs(ecfg, modes, layouts, hops, c_hops)
        with local_serve(args.port or 0, progress, apps=len(configs)) as base, \
                deployed(base, configs, progress) as urls:
            engine = local_engine(ecfg)
            try:
                report = compare(list(urls.values()), prompts, streams, args.max_tokens, engine,
                                 api_key=api_key, timeout=args.timeout, progress=progress)
            finally:
                if engine is not None:
                    engine.close()
        return finish(report, ecfg)

    # servers already running: the in-process engine copies the first one's slots and chain unless flags say
    first = http_bench.describe(args.url[0], api_key)
    if first["model"] != args.model and not args.no_in_process:
        progress(f"warning: {args.url[0]} serves {first['model']!r}; the in-process engine loads {args.model!r}")
    ecfg = engine_config(args, args.slots or first["slots"] or max(streams), args.spec or first["chain"])
    extra = {"speculative": {"chain": args.spec}} if args.spec else {}
    engine = local_engine(ecfg)
    try:
        report = compare(args.url, prompts, streams, args.max_tokens, engine, extra, api_key, args.timeout, progress)
    finally:
        if engine is not None:
            engine.close()
    # without the in-process row nothing loads --model: the header names what the first server serves
    return finish(report, ecfg, None if engine is not None else first)
