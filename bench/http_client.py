"""Throughput of one running specray server over HTTP (streamed completions).

`run(url, prompts, c, ...)`: `c` client threads pull prompts from a shared
list and stream each answer (chat prompts to /v1/chat/completions, raw ones to
/v1/completions); aggregate tokens/s = completion tokens of all requests /
wall time; each request's per-stage timing (bench/stages.py) is summarised
per run. The server's /v1/stats is read before and after, and
`window_figures` turns the two snapshots into the run's own rounds, mean
sequences per target decode and actor hop percentiles (distributed mode).
The in-process engine produces the same snapshot shape (http_bench_local), so
every mode's row is computed the same way. Driven by `specray bench --url` /
`--http` (http_bench_compare); plain `http.client`, so no extra dependency.

Any OpenAI-compatible server works (llama-server included): without /v1/stats
(a 404) a row simply has no server-window figures (rounds, decode widths, hop),
and without a `speculative` object in the usage chunk no acceptance figures.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np

from specray.bench import server_cpu
from specray.bench import stages as stage_mod
from specray.engine.round_stages import breakdown

#: a prompt as the bench sends it: {"prompt": str} (raw, /v1/completions) or {"messages": [...]} (chat)
Prompt = dict


class HTTPStatusError(RuntimeError):
    """A non-200 answer; `status` says which (a 404 on /v1/stats = not a specray server)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Server:
    """One HTTP connection to a server at a time (one Server per client thread).

    A streamed request gets a connection of its own, opened by `connect()` before the request's timing starts
    and closed after its response: llama-server closes the connection after every streamed response (while
    saying keep-alive), so reusing it fails the next request with RemoteDisconnected, or costs a retry inside
    the timing. Connecting outside the timing treats every server alike.
    """

    def __init__(self, url: str, timeout: float = 600, api_key: str | None = None) -> None:
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.conn = cls(parts.hostname, parts.port, timeout=timeout)
        self.prefix = parts.path.rstrip("/")
        # the per-stage timing in every stream's final chunk (deployments/http/timing.py; bench/stages.py)
        self.headers = {"Content-Type": "application/json", "X-Specray-Timing": "1"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> None:
        """Open the connection now unless it is open (call it before starting a request's clock)."""
        if self.conn.sock is None:
            self.conn.connect()

    def get_json(self, path: str) -> dict:
        self.connect()
        self.conn.request("GET", self.prefix + path, headers=self.headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise HTTPStatusError(f"GET {path}: HTTP {r.status}: {data[:300]!r}", r.status)
        return json.loads(data)

    def stream(self, path: str, body: dict) -> list[tuple[float, dict]]:
        """POST with stream=true; every SSE `data:` object until [DONE], each with the time.perf_counter() of
        the read that brought it (parse_sse).

        The response is read to its end first and parsed after it: while a stream runs the client only reads,
        one read a chunk. On a small box the client shares its cores with the server it measures, and parsing
        each chunk's JSON as it comes would take CPU from the server's decode threads (docs/benchmarking.md).
        """
        self.connect()
        self.conn.request("POST", self.prefix + path, body=json.dumps(body), headers=self.headers)
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        reads: list[tuple[float, bytes]] = []
        try:
            while True:
                data = r.read1(65536)  # what has arrived of the current HTTP chunk (or the body), at most 64 KiB
                if not data:
                    break
                reads.append((time.perf_counter(), data))
                if data.rstrip().endswith(b"data: [DONE]"):
                    break
        finally:
            self.conn.close()  # see the class docstring: the next request connects afresh, outside its timing
        return parse_sse(reads)

    def close(self) -> None:
        self.conn.close()


def parse_sse(reads: list[tuple[float, bytes]]) -> list[tuple[float, dict]]:
    """Each SSE `data:` object in `reads` ((time, bytes) in arrival order) up to `data: [DONE]`, with the time
    of the read that completed its line; other lines (comments, `event:`, blank) are skipped.

    >>> parse_sse([(1.0, b'data: {"a": 1}\\n\\ndata: {"b"'), (2.0, b': 2}\\n\\n: ping\\n\\ndata: [DONE]\\n\\n')])
    [(1.0, {'a': 1}), (2.0, {'b': 2})]
    >>> parse_sse([(1.0, b'data: {"c": 3}')])  # a last line without its newline still counts
    [(1.0, {'c': 3})]
    """
    out: list[tuple[float, dict]] = []
    buf = b""
    t = 0.0
    for t, data in reads:
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line == b"data: [DONE]":
                return out
            if line.startswith(b"data: "):
                out.append((t, json.loads(line[6:])))
    line = buf.strip()
    if line.startswith(b"data: ") and line != b"data: [DONE]":
        out.append((t, json.loads(line[6:])))
    return out


def get_json(url: str, path: str, api_key: str | None = None, timeout: float = 60) -> dict:
    s = Server(url, timeout, api_key)
    try:
        return s.get_json(path)
    finally:
        s.close()


def get_stats(url: str, api_key: str | None = None) -> dict | None:
    """/v1/stats, or None from a server that has none (llama-server, any other OpenAI-compatible one)."""
    try:
        return get_json(url, "/v1/stats", api_key)
    except HTTPStatusError as e:
        if e.status == 404:
            return None
        raise


def describe(url: str, api_key: str | None = None) -> dict:
    """What the server says about itself: mode, model, chain, slots, layout (labels the bench rows); all but
    the model are None from a server without /v1/stats."""
    st = get_stats(url, api_key) or {}
    models = get_json(url, "/v1/models", api_key).get("data") or [{}]
    return {"url": url.rstrip("/"), "mode": st.get("mode"), "model": models[0].get("id"), "chain": st.get("chain"),
            "slots": st.get("slots"), "n_ctx": st.get("n_ctx"), "owned_by": models[0].get("owned_by"),
            "layout": (st.get("ingress") or {}).get("layout"), "target_hop": (st.get("hop") or {}).get("mode"),
            "companion_hop": ((st.get("companion") or {}).get("hop") or {}).get("mode")}


def server_kind(info: dict) -> str:
    """A row label from describe(): specray's mode, else llama-server (its /v1/models says owned_by
    "llamacpp"), else "other".

    >>> [server_kind(i) for i in ({"mode": "colocated"}, {"mode": None, "owned_by": "llamacpp"}, {"mode": None})]
    ['colocated', 'llama-server', 'other']
    >>> server_kind({"mode": "distributed", "target_hop": "compiled"})
    'distributed+compiled'
    >>> server_kind({"mode": "distributed", "target_hop": "actor", "companion_hop": "compiled"})
    'distributed+companion-compiled'
    """
    if info.get("mode"):
        return (info["mode"] + ("+compiled" if info.get("target_hop") == "compiled" else "")
                + ("+companion-compiled" if info.get("companion_hop") == "compiled" else ""))
    return "llama-server" if info.get("owned_by") == "llamacpp" else "other"


def request_body(prompt: Prompt, max_tokens: int, extra: dict) -> tuple[str, dict]:
    # include_usage: llama-server (like OpenAI) sends usage in a stream only when asked; specray always does.
    # cache_prompt false: every configuration and client count prefills its prompts in full, as the in-process
    # engine does (a prompt the server saw in an earlier run would otherwise come from its prompt cache)
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}} | extra
    if prompt.get("json_schema") is not None:  # structured output: OpenAI's shape, which llama-server takes too
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": prompt["json_schema"]}}
    if prompt.get("grammar") is not None:
        body["grammar"] = prompt["grammar"]
    if prompt.get("messages") is not None:
        return "/v1/chat/completions", body | {"messages": prompt["messages"]}
    return "/v1/completions", body | {"prompt": prompt["prompt"]}


def one_request(server: Server, prompt: Prompt, max_tokens: int, extra: dict) -> dict:
    path, body = request_body(prompt, max_tokens, extra)
    server.connect()  # outside the timing: a reconnect is the client's business
    t0 = time.perf_counter()
    ttft = None
    usage = spec = timing = None
    client_ms = 0.0
    objs = server.stream(path, body)
    seconds = time.perf_counter() - t0
    for t, obj in objs:
        if "error" in obj:
            raise RuntimeError(obj["error"].get("message"))
        for ch in obj.get("choices") or ():
            text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if text and ttft is None:
                ttft = t - t0
        if obj.get("usage"):
            usage, spec = obj["usage"], obj.get("speculative")
        if "specray_timing" in obj:  # the final chunk: the client's end-to-end ends here, as the ingress's does
            client_ms = 1000.0 * (t - t0)
            timing = obj["specray_timing"]
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    return {"seconds": seconds, "ttft": ttft, "tokens": usage["completion_tokens"],
            "speculative": spec,  # None: the server reports no speculation figures
            "stages": stage_mod.request_stages(timing, client_ms) if timing is not None else None}


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def window_figures(before: dict | None, after: dict | None) -> dict:
    """The run's own figures from two /v1/stats-shaped snapshots (counters are cumulative); {} without them."""
    if before is None or after is None:
        return {}
    sb, sa = before["scheduler"], after["scheduler"]
    rounds = sa["rounds"] - sb["rounds"]
    per_round = max(1, rounds)
    out: dict = {
        "rounds": rounds,
        "round_ms": round(1000 * (sa["round_seconds"] - sb["round_seconds"]) / per_round, 3),
        "target_ms_per_round": round(1000 * (sa["target_seconds"] - sb["target_seconds"]) / per_round, 3),
        "draft_ms_per_round": round(1000 * (sa["draft_seconds"] - sb["draft_seconds"]) / per_round, 3),
    }
    if "stage_seconds" in sa:  # the served rounds' host time: all but the target's decode
        stages = {k: v - sb.get("stage_seconds", {}).get(k, 0.0) for k, v in sa["stage_seconds"].items()}
        b = breakdown(stages, rounds, sa.get("seq_rounds", 0) - sb.get("seq_rounds", 0))
        out["host_ms_per_round"] = round(b["host_ms_per_round"], 3) if b["host_ms_per_round"] is not None else None
        out["round_stages_ms"] = {k: round(v, 3) for k, v in b["ms_per_round"].items()}
    tb, ta = before.get("target") or {}, after.get("target") or {}
    decodes = ta.get("step_decodes", 0) - tb.get("step_decodes", 0)
    out["target_decodes"] = decodes
    out["mean_seqs_per_decode"] = (round((ta["step_decode_seqs"] - tb["step_decode_seqs"]) / decodes, 3)
                                   if decodes else None)
    out["multi_seq_decodes"] = ta.get("multi_seq_decodes", 0) - tb.get("multi_seq_decodes", 0)
    hb, ha = before.get("hop"), after.get("hop")
    if ha is not None and hb is not None:
        calls = ha["calls"] - hb["calls"]
        total_ms = ha["mean_ms"] * ha["calls"] - hb["mean_ms"] * hb["calls"]
        recent = ha.get("recent_ms") or []
        window = recent[-calls:] if calls else []
        out["hop"] = {
            "calls": calls,  # one per round, plus a flush when the router goes idle with releases pending
            "mean_ms": round(total_ms / calls, 3) if calls else None,
            "per_round_ms": round(total_ms / rounds, 3) if rounds else None,
            "p50_ms": _percentile(window, 50),
            "p95_ms": _percentile(window, 95),
            # the server keeps the last len(recent_ms) hops; a longer run has percentiles of its tail only
            "percentiles_of_last": len(window),
        }
    return out


def aggregate(results: list[dict], errors: list[str], wall: float, concurrency: int) -> dict:
    """Client-side figures of one run (requests' tokens, latency, speculation)."""
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    specs = [r["speculative"] for r in results if r["speculative"] is not None]
    drafts = sum(s.get("drafts", 0) for s in specs)
    drafted = sum(s.get("drafted_tokens", 0) for s in specs)
    accepted = sum(s.get("accepted_tokens", 0) for s in specs)
    known = bool(specs)  # a server without speculation figures: None, not a made-up 1.0
    return {
        "streams": concurrency,
        "requests": len(results),
        "errors": errors[:10],
        "n_errors": len(errors),
        "completion_tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "mean_latency_s": round(sum(r["seconds"] for r in results) / len(results), 3) if results else None,
        "mean_ttft_ms": round(1000 * sum(ttfts) / len(ttfts), 1) if ttfts else None,
        "acceptance_rate": (round(accepted / drafted, 3) if drafted else 0.0) if known else None,
        "mean_acceptance_length": (round(1 + accepted / drafts, 3) if drafts else 1.0) if known else None,
        "drafted_tokens": drafted if known else None,
        "accepted_tokens": accepted if known else None,
        "stages": stage_mod.summarize([(r["stages"], r["tokens"]) for r in results if r.get("stages")]),
    }


def run_clients(url: str, items: list, concurrency: int, timeout: float, api_key: str | None,
                handle: Callable[[Server, object], None]) -> float:
    """Run `concurrency` client threads that take the items off one queue in order and call handle(server,
    item) with a Server of their own (closed when the queue is empty); returns the wall seconds they took."""
    work: queue.Queue = queue.Queue()
    for item in items:
        work.put(item)

    def worker() -> None:
        server = Server(url, timeout, api_key)
        try:
            while True:
                try:
                    item = work.get_nowait()
                except queue.Empty:
                    return
                handle(server, item)
        finally:
            server.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run(url: str, prompts: list[Prompt], concurrency: int, max_tokens: int = 128, extra: dict | None = None,
        timeout: float = 600, api_key: str | None = None) -> dict:
    """Stream every prompt with `concurrency` client threads; aggregate + server-window figures."""
    url = url.rstrip("/")
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def handle(server: Server, p: Prompt) -> None:
        try:
            res = one_request(server, p, max_tokens, extra or {})
            with lock:
                results.append(res)
        except Exception as e:
            server.close()  # a broken stream leaves the connection unusable; reconnect lazily
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    before = get_stats(url, api_key)
    # the server's processes on this machine: CPU per token, decode threads and the rest (bench/server_cpu.py)
    pids = server_cpu.server_pids(before) if before is not None and server_cpu.is_local(url) else []
    decoding = server_cpu.decode_tids(before)
    # and Ray's own processes beside them (the daemons, Serve's controller and proxy)
    ray_pids = server_cpu.ray_pids(exclude=pids) if pids else []
    cpu_before = server_cpu.cpu_seconds(pids, decoding) | {"ray": server_cpu.process_seconds(ray_pids)} if pids else None
    wall = run_clients(url, prompts, concurrency, timeout, api_key, handle)
    cpu_after = server_cpu.cpu_seconds(pids, decoding) | {"ray": server_cpu.process_seconds(ray_pids)} if pids else None
    after = get_stats(url, api_key) if before is not None else None
    agg = aggregate(results, errors, wall, concurrency)
    cpu = server_cpu.per_token(cpu_before, cpu_after, agg["completion_tokens"]) if pids else None
    return {"url": url, "mode": (after or {}).get("mode")} | agg | window_figures(before, after) | \
        ({"server_cpu": cpu | {"processes": len(pids), "ray_processes": len(ray_pids)}} if cpu else {})
