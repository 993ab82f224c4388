"""`specray bench --url URL --agents N`: many multi-turn conversations sharing one long system prompt, C at a time.

The agent workload: N conversations send the same system prompt (a tool catalogue with numbered rules, about
--system-tokens tokens, generated here deterministically) and T turns each (--turns, default 3). Turn t sends
the system prompt, the whole history (earlier user messages and the server's own answers) and a new user
message; user messages are Spec-Bench's multi-turn (MT-bench) questions, chained as in bench/multiturn.py, so
no two conversations share one. C conversations (--concurrency) run at a time, each its turns in order, on
client threads; every request is streamed and greedy with max_tokens (--max-tokens), cache_prompt true.

Per request: the client-side time to first token (request sent -> first non-empty content chunk), prompt,
completion and cached prompt tokens as the server reports them (bench/multiturn.py's request_turn). Per server:
TTFT p50/p90 of first turns and of later turns, wall time, output tokens/s (completion tokens / wall time),
cached tokens (median, and their share of the prompt tokens), requests and errors. A request that fails ends
its conversation (the next turn would need its answer). Several --url servers run one after another, each the
whole workload after one unmeasured warm-up request; their TTFT p50s are compared with the first server's.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time

from specray.bench.http_client import Server, run_clients
from specray.bench.multiturn import chain_turns, load_multiturn, request_turn, turn_messages
from specray.bench.report import print_report

DEFAULT_TURNS = 3
DEFAULT_CONCURRENCY = 4
DEFAULT_SYSTEM_TOKENS = 1600
# characters per token of the catalogue's JSON-ish English (SmolLM2's tokenizer: about 3.7); it only sizes
# the prompt, the servers report the real count
CHARS_PER_TOKEN = 3.7

_VERBS = ("search", "get", "create", "update", "delete", "list", "summarize", "export", "validate", "schedule",
          "archive", "compare")
_NOUNS = ("invoice", "customer", "ticket", "calendar_event", "file", "email", "order", "shipment", "report",
          "user_account", "payment", "product")
_TYPES = ("string", "integer", "boolean", "string", "number")
_RULES = (
    "Call a tool only when the user's request needs data you do not already have in the conversation.",
    "Never invent identifiers: ask the user for a missing {noun} id instead of guessing one.",
    "Before calling {verb}_{noun}, check that every required parameter is present and of the declared type.",
    "When a tool returns an error, explain it in one sentence and propose the next step.",
    "Answer in the user's language; keep tool names and parameter names in English.",
    "Do not call more than three tools for one user message; summarise what you found after the last call.",
    "Confirm with the user before any delete_ or update_ call that changes a {noun}.",
    "Quote amounts with their currency and dates in ISO 8601 (YYYY-MM-DD).",
)


def approx_tokens(text: str) -> int:
    """A rough token count of `text` (characters / CHARS_PER_TOKEN), to size the system prompt without a tokenizer.

    >>> approx_tokens("x" * 37)
    10
    """
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _tool(i: int) -> str:
    verb, noun = _VERBS[i % len(_VERBS)], _NOUNS[(i // len(_VERBS)) % len(_NOUNS)]
    name = f"{verb}_{noun}" + (f"_v{i // (len(_VERBS) * len(_NOUNS)) + 1}" if i >= len(_VERBS) * len(_NOUNS) else "")
    words = noun.replace("_", " ")
    params = {f"{noun}_id": {"type": "string", "description": f"the {words}'s identifier"}}
    for k in range(1 + i % 3):
        params[f"option_{k + 1}"] = {"type": _TYPES[(i + k) % len(_TYPES)],
                                     "description": f"setting {k + 1} of {verb} for this {words}"}
    tool = {"name": name, "description": f"{verb.capitalize()} {_article(noun)} {words} in the company system.",
            "parameters": {"type": "object", "properties": params, "required": [f"{noun}_id"]}}
    return json.dumps(tool)


def _rule(i: int) -> str:
    return _RULES[i % len(_RULES)].format(verb=_VERBS[(i * 5) % len(_VERBS)], noun=_NOUNS[(i * 7) % len(_NOUNS)])


def system_prompt(tokens: int) -> str:
    """A deterministic agent system prompt of about `tokens` tokens (approx_tokens): a header, a catalogue of
    JSON tool definitions and numbered rules, one tool and one rule added in turn, stopping at the size nearest
    `tokens`. The same `tokens` always gives the same text, and a larger one extends a smaller one's catalogue.

    >>> p = system_prompt(300)
    >>> p == system_prompt(300), p.startswith("You are an assistant"), 250 <= approx_tokens(p) < 350
    (True, True, True)
    >>> '"name": "search_invoice"' in p and "1. Call a tool only" in p
    True
    """
    header = ("You are an assistant that helps the staff of a company with their records. You can call the "
              "tools below; answer the user directly when no tool is needed.\n")
    tools: list[str] = []
    rules: list[str] = []

    def text() -> str:
        return (header + "\n# Tools\n" + "\n".join(tools) + "\n\n# Rules\n"
                + "\n".join(f"{k + 1}. {r}" for k, r in enumerate(rules)) + "\n")

    prev = text()
    while approx_tokens(prev) < tokens:
        if len(tools) <= len(rules):
            tools.append(_tool(len(tools)))
        else:
            rules.append(_rule(len(rules)))
        cur = text()
        if approx_tokens(cur) >= tokens:  # the nearer of the last two sizes
            return cur if approx_tokens(cur) - tokens <= tokens - approx_tokens(prev) else prev
        prev = cur
    return prev


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, linearly interpolated as numpy's default; None when empty.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 90), percentile([5.0], 90)
    (2.5, 3.7, 5.0)
    >>> percentile([], 50) is None
    True
    """
    if not values:
        return None
    vals = sorted(values)
    pos = (len(vals) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return round(vals[lo] + (vals[hi] - vals[lo]) * (pos - lo), 3)


def _phase(records: list[dict]) -> dict:
    ttfts = [r["ttft_ms"] for r in records if r.get("ttft_ms") is not None]
    prompt = [r["prompt_tokens"] for r in records if r.get("prompt_tokens") is not None]
    cached = [r["cached_tokens"] for r in records if r.get("cached_tokens") is not None]
    with_both = [r for r in records if r.get("prompt_tokens") and r.get("cached_tokens") is not None]
    share = (sum(r["cached_tokens"] for r in with_both) / sum(r["prompt_tokens"] for r in with_both)
             if with_both else None)
    server = {k: [r[k] for r in records if r.get(k) is not None] for k in ("server_prompt_ms", "server_queue_ms")}
    return {"requests": len(records), "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "prompt_tokens_median": statistics.median(prompt) if prompt else None,
            "cached_tokens_median": statistics.median(cached) if cached else None,
            "cached_share": None if share is None else round(share, 3),
            # the server's own split of the time to first token (multiturn.server_side): p50 and p90
            "server_prompt_p50_ms": percentile(server["server_prompt_ms"], 50),
            "server_prompt_p90_ms": percentile(server["server_prompt_ms"], 90),
            "server_queue_p50_ms": percentile(server["server_queue_ms"], 50),
            "server_queue_p90_ms": percentile(server["server_queue_ms"], 90)}


def summarize(records: list[dict], wall_s: float) -> dict:
    """One server's figures from its requests' records (`turn` 1-based; failed requests have `error`): TTFT
    p50/p90, median prompt and cached tokens and the cached share (sum cached / sum prompt) for first turns and
    for later turns; wall time, completion tokens and output tokens/s (over the wall time), requests, errors.

    >>> recs = [{"turn": 1, "ttft_ms": 100.0, "prompt_tokens": 50, "cached_tokens": 0, "completion_tokens": 8},
    ...         {"turn": 1, "ttft_ms": 300.0, "prompt_tokens": 52, "cached_tokens": 40, "completion_tokens": 8},
    ...         {"turn": 2, "ttft_ms": 20.0, "prompt_tokens": 80, "cached_tokens": 60, "completion_tokens": 8},
    ...         {"turn": 2, "error": "RuntimeError: boom"}]
    >>> s = summarize(recs, 2.0)
    >>> s["first"]["ttft_p50_ms"], s["first"]["ttft_p90_ms"], s["later"]["cached_share"], s["later"]["requests"]
    (200.0, 280.0, 0.75, 1)
    >>> s["requests"], s["errors"], s["completion_tokens"], s["tokens_per_s"]
    (4, 1, 24, 12.0)
    """
    ok = [r for r in records if "error" not in r]
    tokens = sum(r.get("completion_tokens") or 0 for r in ok)
    return {"requests": len(records), "errors": len(records) - len(ok), "wall_s": round(wall_s, 3),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
            "first": _phase([r for r in ok if r["turn"] == 1]), "later": _phase([r for r in ok if r["turn"] > 1])}


def run_agent(server: Server, system: str, users: list[str], max_tokens: int, extra: dict | None,
              agent: int) -> list[dict]:
    """One conversation's turns in order, each answer appended to the history; one record per request (the
    answer's text left out). A failed request is recorded with its error and ends the conversation."""
    records: list[dict] = []
    answers: list[str] = []
    for t in range(len(users)):
        messages = [{"role": "system", "content": system}] + turn_messages(users, answers, t)
        try:
            rec = request_turn(server, messages, max_tokens, True, extra)
        except Exception as e:  # noqa: BLE001 - any failure is one error of the run, reported, not raised
            server.close()
            records.append({"agent": agent, "turn": t + 1, "error": f"{type(e).__name__}: {e}"})
            break
        answers.append(rec.pop("text"))
        records.append({"agent": agent, "turn": t + 1} | rec)
    return records


def run_server(url: str, system: str, users_per_agent: list[list[str]], concurrency: int, max_tokens: int,
               extra: dict | None = None, api_key: str | None = None, timeout: float = 600,
               progress=None) -> dict:
    """Every conversation on one server, `concurrency` at a time (client threads taking the next conversation
    when theirs ends), after one unmeasured warm-up request; the records and summarize()'s figures."""
    warm = Server(url, timeout, api_key)
    try:  # the first request pays for lazy set-up; it shares nothing with the workload's prompts
        request_turn(warm, [{"role": "user", "content": "Say hello."}], 4, False, extra)
    finally:
        warm.close()
    records: list[dict] = []
    lock = threading.Lock()

    def handle(server: Server, item: tuple[int, list[str]]) -> None:
        k, users = item
        recs = run_agent(server, system, users, max_tokens, extra, k)
        with lock:
            records.extend(recs)
            done = len({r["agent"] for r in records})
        if progress:
            progress(f"  conversation {k + 1} done ({done}/{len(users_per_agent)})")

    wall = run_clients(url, list(enumerate(users_per_agent)), min(concurrency, len(users_per_agent)), timeout,
                       api_key, handle)
    records.sort(key=lambda r: (r["agent"], r["turn"]))
    return {"url": url.rstrip("/"), "records": records, "summary": summarize(records, wall)}


def ratios(results: list[dict]) -> list[dict]:
    """Each server's TTFT p50s over the first server's (first and later turns); None where either is missing.

    >>> r = ratios([{"label": "a", "summary": {"first": {"ttft_p50_ms": 100.0}, "later": {"ttft_p50_ms": 10.0}}},
    ...             {"label": "b", "summary": {"first": {"ttft_p50_ms": 50.0}, "later": {"ttft_p50_ms": None}}}])
    >>> r[1]
    {'label': 'b', 'first_ttft_p50': 0.5, 'later_ttft_p50': None}
    """
    base = results[0]["summary"]
    out = []
    for res in results:
        row = {"label": res["label"]}
        for phase in ("first", "later"):
            a, b = res["summary"][phase]["ttft_p50_ms"], base[phase]["ttft_p50_ms"]
            row[f"{phase}_ttft_p50"] = round(a / b, 3) if a is not None and b else None
        out.append(row)
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def report_text(report: dict) -> str:
    """The table: one row per server; TTFT in ms, `prompt`/`cached` the later turns' medians, `share` their
    sum cached / sum prompt; the later turns' time to first token as the servers account for it (prompt
    processing, and specray's queue before it: multiturn.server_side); then the ratio line with two or more
    servers.

    >>> ph = lambda p50, p90, sp=None, sq=None: {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "prompt_tokens_median": 90,
    ...     "cached_tokens_median": 80, "cached_share": 0.9, "server_prompt_p50_ms": sp, "server_prompt_p90_ms": sp,
    ...     "server_queue_p50_ms": sq, "server_queue_p90_ms": sq}
    >>> s = {"requests": 6, "errors": 0, "wall_s": 2.5, "tokens_per_s": 19.2, "first": ph(300.0, 420.0),
    ...      "later": ph(40.0, 55.0, 30.0, 6.0)}
    >>> rep = {"meta": {"agents": 2, "turns": 3, "concurrency": 2, "system_tokens": 300, "max_tokens": 8},
    ...        "targets": [{"label": "a", "url": "http://h:1", "summary": s},
    ...                    {"label": "b", "url": "http://h:2", "summary": s | {"later": ph(40.0, 55.0, 35.0)}}],
    ...        "ratios": [{"label": "a", "first_ttft_p50": 1.0, "later_ttft_p50": 1.0},
    ...                   {"label": "b", "first_ttft_p50": 1.0, "later_ttft_p50": 1.0}]}
    >>> print(report_text(rep))  # doctest: +NORMALIZE_WHITESPACE
    agents: 2 conversations x 3 turns, 2 at a time, system prompt ~300 tokens, 8 tokens per answer
    TTFT ms, client side; prompt, cached, share: later turns (median, median, sum cached / sum prompt)
    server  req  err  wall s  tok/s  first p50  first p90  later p50  later p90  prompt  cached  share
         a    6    0    2.50   19.2      300.0      420.0       40.0       55.0      90      80  90.0%
         b    6    0    2.50   19.2      300.0      420.0       40.0       55.0      90      80  90.0%
    later turns, server side, ms p50 / p90: a prompt 30 / 30, queue 6 / 6; b prompt 35 / 35
    TTFT p50 vs a: b first turns 1.00x, later turns 1.00x
    """
    m = report["meta"]
    w = max([len("server")] + [len(r["label"]) for r in report["targets"]])
    lines = [f"agents: {m['agents']} conversations x {m['turns']} turns, {m['concurrency']} at a time, system prompt "
             f"~{m['system_tokens']} tokens, {m['max_tokens']} tokens per answer",
             "TTFT ms, client side; prompt, cached, share: later turns (median, median, sum cached / sum prompt)",
             f"{'server':>{w}}{'req':>5}{'err':>5}{'wall s':>8}{'tok/s':>7}{'first p50':>11}{'first p90':>11}"
             f"{'later p50':>11}{'later p90':>11}{'prompt':>8}{'cached':>8}{'share':>7}"]
    for res in report["targets"]:
        s = res["summary"]
        f, la = s["first"], s["later"]
        share = "-" if la["cached_share"] is None else f"{100 * la['cached_share']:.1f}%"
        lines.append(f"{res['label']:>{w}}{s['requests']:>5}{s['errors']:>5}{s['wall_s']:>8.2f}"
                     f"{_f(s['tokens_per_s'], '.1f'):>7}{_f(f['ttft_p50_ms'], '.1f'):>11}"
                     f"{_f(f['ttft_p90_ms'], '.1f'):>11}{_f(la['ttft_p50_ms'], '.1f'):>11}"
                     f"{_f(la['ttft_p90_ms'], '.1f'):>11}{_f(la['prompt_tokens_median'], '.0f'):>8}"
                     f"{_f(la['cached_tokens_median'], '.0f'):>8}{share:>7}")
    split = [(r["label"], r["summary"]["later"]) for r in report["targets"]
             if r["summary"]["later"].get("server_prompt_p50_ms") is not None]
    if split:  # where a later turn's first token waits, by the server's own account
        lines.append("later turns, server side, ms p50 / p90: " + "; ".join(
            f"{lab} prompt {_f(la['server_prompt_p50_ms'], '.0f')} / {_f(la['server_prompt_p90_ms'], '.0f')}"
            + ("" if la.get("server_queue_p50_ms") is None else
               f", queue {_f(la['server_queue_p50_ms'], '.0f')} / {_f(la['server_queue_p90_ms'], '.0f')}")
            for lab, la in split))
    if len(report["targets"]) > 1:
        base = report["targets"][0]["label"]
        parts = [f"{r['label']} first turns {_f(r['first_ttft_p50'], '.2f')}x, later turns "
                 f"{_f(r['later_ttft_p50'], '.2f')}x" for r in report["ratios"][1:]]
        lines.append(f"TTFT p50 vs {base}: " + "; ".join(parts))
    return "\n".join(lines)


def agent_users(path: str, n_agents: int, n_turns: int) -> list[list[str]]:
    """The user messages of `n_agents` conversations of `n_turns` (chain_turns over the file's multi-turn
    entries), with the error in this bench's flags when the entries run out."""
    try:
        return chain_turns(load_multiturn(path), n_turns, n_agents)
    except ValueError as e:
        if "ran out" not in str(e):
            raise
        raise ValueError(f"{n_agents} agents of {n_turns} turns: {path}'s multi-turn entries ran out (fewer "
                         "--agents or --turns)") from None


def main_agents(args) -> int:
    """`specray bench --url URL [--url URL] --agents [N] [--turns T] [--concurrency C] [--system-tokens S]`."""
    import os
    import sys

    from specray.bench.http_client import describe, server_kind
    from specray.bench.prompts import default_prompts_path

    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    path = args.prompts or default_prompts_path()
    n_turns = args.turns or DEFAULT_TURNS
    concurrency = args.concurrency or DEFAULT_CONCURRENCY
    system_tokens = args.system_tokens or DEFAULT_SYSTEM_TOKENS
    users = agent_users(path, args.agents, n_turns)
    system = system_prompt(system_tokens)
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    infos = [describe(u, api_key) for u in args.url]
    labels = [f"specray {i['mode']}" if i["mode"] else server_kind(i) for i in infos]
    labels = [lab if labels.count(lab) == 1 else f"{lab}@{u}" for lab, u in zip(labels, args.url)]
    extra = {"speculative": {"chain": args.spec}} if args.spec else None
    targets = []
    for url, label in zip(args.url, labels):
        progress(f"{label}: {args.agents} conversations x {n_turns} turns, {concurrency} at a time")
        targets.append({"label": label} | run_server(url, system, users, concurrency, args.max_tokens, extra,
                                                     api_key, args.timeout, progress))
    report = {"kind": "specray-agents-bench", "targets": targets, "ratios": ratios(targets),
              "meta": {"agents": args.agents, "turns": n_turns, "concurrency": concurrency,
                       "system_tokens": system_tokens, "system_chars": len(system), "max_tokens": args.max_tokens,
                       "prompts_path": path, "servers": infos, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "cpus": os.cpu_count(), "command": " ".join(sys.argv)}}
    return print_report(report_text(report), report, args.json)
