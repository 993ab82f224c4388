"""`specray bench --url URL --turns N`: multi-turn chat time to first token, prompt cache on vs off.

A conversation of N turns: turn t sends the whole history (every earlier user
message and assistant answer) plus a new user message, so the prompt grows
every turn and, with a prompt cache, all but the new tail is already in the KV
cache. User messages come from Spec-Bench's multi-turn (MT-bench) entries,
chained: 6 turns = the two turns of three consecutive entries. Each
conversation runs twice, streamed and greedy with a fixed max_tokens: first
all its turns with `cache_prompt: true` in the body (the field name
llama-server and specray share), then the same turns, the very same messages
(the history holds the cache-on answers), with `cache_prompt: false`. Cache on
goes first and whole: a cache-off request of the same turn in between would
leave that turn's prompt in the server's KV cache (llama-server keeps it in
the slot), and the next cache-on request would find more cached than a real
conversation ever does; after the cache-on run, a cache-off request reuses
nothing whatever the cache holds. Per request: the client-side time to first
token (request sent on an open connection -> first non-empty content chunk),
the prompt tokens and the cached prompt tokens the server reports
(`usage.prompt_tokens_details.cached_tokens`, else llama-server's
`timings.cache_n`). Any OpenAI-compatible server works; nothing here reads
/v1/stats. Conversations (--conversations) run one after another, one request
at a time (on, off, on, off, ...: drift hits both alike); per turn the table
shows medians over them.
"""

from __future__ import annotations

import statistics
import time

from specray.bench.http_client import Server
from specray.bench.prompts import read_jsonl
from specray.bench.report import print_report

DEFAULT_CONVERSATIONS = 3


def chain_turns(entries: list[list[str]], n_turns: int, n_conversations: int) -> list[list[str]]:
    """User messages of `n_conversations` conversations of `n_turns` each: entries' turns chained in order,
    each entry used once (so no conversation shares a user message with another).

    >>> chain_turns([["a1", "a2"], ["b1", "b2"], ["c1", "c2"], ["d1", "d2"]], 3, 2)
    [['a1', 'a2', 'b1'], ['c1', 'c2', 'd1']]
    >>> chain_turns([["a1", "a2"]], 3, 1)
    Traceback (most recent call last):
    ...
    ValueError: 1 conversation(s) of 3 turns: the 1 multi-turn entries ran out (fewer --conversations or --turns)
    """
    out: list[list[str]] = []
    it = iter(entries)
    used = 0
    for _ in range(n_conversations):
        users: list[str] = []
        while len(users) < n_turns:
            entry = next(it, None)
            if entry is None:
                raise ValueError(f"{n_conversations} conversation(s) of {n_turns} turns: the {used} multi-turn "
                                 "entries ran out (fewer --conversations or --turns)")
            used += 1
            users.extend(entry[: n_turns - len(users)])
        out.append(users)
    return out


def load_multiturn(path: str) -> list[list[str]]:
    """The `turns` lists of a JSONL file's entries that have two or more (Spec-Bench: the 80 MT-bench ones)."""
    entries = []
    for _, obj in read_jsonl(path):
        turns = obj.get("turns")
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) for t in turns):
            entries.append(turns)
    if not entries:
        raise ValueError(f"{path}: no entries with two or more 'turns' (the multi-turn bench needs Spec-Bench's "
                         "MT-bench questions or the like)")
    return entries


def turn_messages(users: list[str], answers: list[str], turn: int) -> list[dict]:
    """The chat messages of turn `turn` (0-based): earlier user messages and answers alternating, then the
    turn's own user message.

    >>> [m["role"] + ":" + m["content"] for m in turn_messages(["hi", "more"], ["hello"], 1)]
    ['user:hi', 'assistant:hello', 'user:more']
    >>> turn_messages(["hi"], [], 0)
    [{'role': 'user', 'content': 'hi'}]
    """
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
    msgs: list[dict] = []
    for u, a in zip(users[:turn], answers[:turn]):
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": users[turn]}]


def cached_tokens(final: dict) -> int | None:
    """Cached prompt tokens from a stream's usage/timings chunk: OpenAI's
    `usage.prompt_tokens_details.cached_tokens`, else llama-server's `timings.cache_n`, else None (not reported).

    >>> cached_tokens({"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}})
    64
    >>> cached_tokens({"usage": {"prompt_tokens": 90}, "timings": {"cache_n": 80, "prompt_n": 10}})
    80
    >>> cached_tokens({"usage": {"prompt_tokens": 90}}) is None
    True
    """
    details = (final.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    cache_n = (final.get("timings") or {}).get("cache_n")
    return None if cache_n is None else int(cache_n)


def server_side(final: dict) -> tuple[float | None, float | None]:
    """(prompt ms, queue ms): the server's own account of a request's time to first token, from the stream's last
    chunks. Prompt: llama-server's `timings.prompt_ms` (its prompt processing), or specray's `prefill` stage (the
    round that gave the request its slot -> its first token). Queue: specray's `tokenize` + `admission` stages
    (request in the engine's process -> its slot); llama-server reports none. None where the server says nothing.

    >>> server_side({"timings": {"prompt_ms": 301.456, "cache_n": 80}})
    (301.46, None)
    >>> server_side({"specray_timing": {"tokenize_ms": 7.5, "admission_ms": 52.5, "prefill_ms": 640.0}})
    (640.0, 60.0)
    >>> server_side({"usage": {"prompt_tokens": 9}})
    (None, None)
    """
    timings, stages = final.get("timings") or {}, final.get("specray_timing") or {}
    if timings.get("prompt_ms") is not None:
        return round(timings["prompt_ms"], 2), None
    if stages.get("prefill_ms") is not None:
        queue = stages.get("tokenize_ms", 0.0) + stages.get("admission_ms", 0.0)
        return round(stages["prefill_ms"], 2), round(queue, 2)
    return None, None


def request_turn(server: Server, messages: list[dict], max_tokens: int, cache_prompt: bool,
                 extra: dict | None = None) -> dict:
    """One streamed, greedy chat request; client-side TTFT and what the server says about the prompt."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache_prompt} | (extra or {})
    server.connect()  # outside the timing: a reconnect is the client's business
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict | None = None
    final: dict = {}
    objs = server.stream("/v1/chat/completions", body)
    seconds = time.perf_counter() - t0
    for t, obj in objs:
        if "error" in obj:
            err = obj["error"]
            raise RuntimeError(err.get("message") if isinstance(err, dict) else str(err))
        for ch in obj.get("choices") or ():
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                if ttft is None:
                    ttft = t - t0
                text.append(piece)
        if obj.get("usage"):
            usage = obj["usage"]
        # llama-server puts timings on the last chunk, specray its stages (asked by the client's timing header)
        final |= {k: obj[k] for k in ("usage", "timings", "specray_timing") if obj.get(k)}
    if usage is None:
        raise RuntimeError("the stream ended without usage (the server ignored stream_options.include_usage)")
    prompt_ms, queue_ms = server_side(final)
    return {
        "ttft_ms": None if ttft is None else round(1000 * ttft, 2),
        "seconds": round(seconds, 4),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": cached_tokens(final),
        "server_prompt_ms": prompt_ms,
        "server_queue_ms": queue_ms,
        "text": "".join(text),
    }


def run_conversation(server: Server, users: list[str], max_tokens: int, extra: dict | None = None,
                     progress=None) -> list[dict]:
    """All turns with the prompt cache on (each turn's history = the earlier answers), then the same
    messages with it off; one record per turn."""
    sent: list[tuple[list[dict], dict]] = []
    answers: list[str] = []
    for t in range(len(users)):
        messages = turn_messages(users, answers, t)
        on = request_turn(server, messages, max_tokens, True, extra)
        answers.append(on["text"])
        sent.append((messages, on))
    records = []
    for t, (messages, on) in enumerate(sent):
        off = request_turn(server, messages, max_tokens, False, extra)
        rec = {"turn": t + 1, "prompt_tokens": on["prompt_tokens"], "on": on, "off": off,
               "same_answer": on["text"] == off["text"]}
        records.append(rec)
        if progress:
            progress(f"  turn {t + 1}: {rec['prompt_tokens']} prompt tokens, TTFT on {on['ttft_ms']} ms, "
                     f"off {off['ttft_ms']} ms, cached {on['cached_tokens']}")
    return records


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(float(statistics.median(vals)), 2) if vals else None


def summarize_turns(conversations: list[list[dict]]) -> list[dict]:
    """Per turn, medians over the conversations: prompt tokens, TTFT with the cache on and off, their ratio
    (off / on: how many times faster the first token comes with the cache) and the cached tokens.

    >>> conv = lambda p, on, off, c: [{"turn": 1, "prompt_tokens": p, "on": {"ttft_ms": on, "cached_tokens": c},
    ...                                "off": {"ttft_ms": off, "cached_tokens": 0}}]
    >>> (row,) = summarize_turns([conv(100, 10.0, 40.0, 90), conv(120, 20.0, 50.0, 110)])
    >>> row["prompt_tokens"], row["ttft_on_ms"], row["ttft_off_ms"], row["ratio"], row["cached_tokens_on"]
    (110.0, 15.0, 45.0, 3.0, 100.0)
    """
    n_turns = max((len(c) for c in conversations), default=0)
    rows = []
    for t in range(n_turns):
        recs = [c[t] for c in conversations if len(c) > t]
        on = _median([r["on"]["ttft_ms"] for r in recs])
        off = _median([r["off"]["ttft_ms"] for r in recs])
        rows.append({
            "turn": t + 1,
            "conversations": len(recs),
            "prompt_tokens": _median([r["prompt_tokens"] for r in recs]),
            "ttft_on_ms": on,
            "ttft_off_ms": off,
            "ratio": round(off / on, 2) if on and off is not None else None,
            "cached_tokens_on": _median([r["on"]["cached_tokens"] for r in recs]),
            "cached_tokens_off": _median([r["off"]["cached_tokens"] for r in recs]),
        })
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def table(result: dict) -> str:
    """One target's turns as text.

    >>> print(table({"label": "specray", "url": "http://h:1", "turns": [
    ...     {"turn": 1, "prompt_tokens": 40.0, "ttft_on_ms": 30.0, "ttft_off_ms": 31.0, "ratio": 1.03,
    ...      "cached_tokens_on": None, "cached_tokens_off": None}]}))
    specray (http://h:1): median over conversations; ratio = TTFT off / TTFT on
    turn  prompt tok  TTFT on ms  TTFT off ms  ratio  cached on  cached off
       1          40        30.0         31.0  1.03x          -           -
    """
    lines = [f"{result['label']} ({result['url']}): median over conversations; ratio = TTFT off / TTFT on",
             f"{'turn':>4}{'prompt tok':>12}{'TTFT on ms':>12}{'TTFT off ms':>13}{'ratio':>7}{'cached on':>11}"
             f"{'cached off':>12}"]
    for r in result["turns"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"{r['turn']:>4}{_f(r['prompt_tokens'], '.0f'):>12}{_f(r['ttft_on_ms'], '.1f'):>12}"
                     f"{_f(r['ttft_off_ms'], '.1f'):>13}{ratio:>7}{_f(r['cached_tokens_on'], '.0f'):>11}"
                     f"{_f(r['cached_tokens_off'], '.0f'):>12}")
    return "\n".join(lines)


def bench(urls: list[str], users_per_conversation: list[list[str]], max_tokens: int, labels: list[str],
          extra: dict | None = None, api_key: str | None = None, timeout: float = 600, progress=print) -> dict:
    """Every conversation on every server (servers interleaved per conversation); one result per server."""
    results = [{"label": lab, "url": u.rstrip("/"), "conversations": []} for lab, u in zip(labels, urls)]
    servers = [Server(u, timeout, api_key) for u in urls]
    try:
        for s, res in zip(servers, results):  # unmeasured: the first request pays for lazy set-up
            request_turn(s, [{"role": "user", "content": "Say hello."}], 4, False, extra)
        for k, users in enumerate(users_per_conversation):
            for s, res in zip(servers, results):
                progress(f"{res['label']}: conversation {k + 1}/{len(users_per_conversation)}")
                res["conversations"].append(run_conversation(s, users, max_tokens, extra, progress))
    finally:
        for s in servers:
            s.close()
    for res in results:
        res["turns"] = summarize_turns(res["conversations"])
        last = res["turns"][-1] if res["turns"] else {}
        res["summary"] = {"last_turn": last.get("turn"), "ratio": last.get("ratio"),
                          "same_answers": sum(r["same_answer"] for c in res["conversations"] for r in c),
                          "requests_per_arm": sum(len(c) for c in res["conversations"])}
    return {"kind": "specray-multiturn-bench", "targets": results}


def report_text(report: dict) -> str:
    out = []
    for res in report["targets"]:
        s = res["summary"]
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        out += [table(res), f"turn {s['last_turn']}: TTFT cache off / on = {ratio}; cache on and off gave the same "
                            f"answer in {s['same_answers']}/{s['requests_per_arm']} turns", ""]
    return "\n".join(out).rstrip()


def main_multiturn(args) -> int:
    """`specray bench --url URL [--url URL] --turns N`."""
    import os
    import sys

    from specray.bench.http_client import describe, server_kind
    from specray.bench.run import default_prompts_path

    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    path = args.prompts or default_prompts_path()
    n_conv = args.conversations or DEFAULT_CONVERSATIONS
    users = chain_turns(load_multiturn(path), args.turns, n_conv)
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    infos = [describe(u, api_key) for u in args.url]
    labels = [f"specray {i['mode']}" if i["mode"] else server_kind(i) for i in infos]
    labels = [lab if labels.count(lab) == 1 else f"{lab}@{u}" for lab, u in zip(labels, args.url)]
    extra = {"speculative": {"chain": args.spec}} if args.spec else None
    report = bench(args.url, users, args.max_tokens, labels, extra, api_key, args.timeout, progress)
    report["meta"] = {"turns": args.turns, "conversations": n_conv, "max_tokens": args.max_tokens,
                      "prompts_path": path, "servers": infos, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    return print_report(report_text(report), report, args.json)
