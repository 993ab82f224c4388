"""Throughput of a running specray server over HTTP (streamed chat completions).

    python -m specray.deployments.http_bench --url http://127.0.0.1:8000 --concurrency 1 8

`c` client threads pull prompts from a shared list and stream each answer;
aggregate tokens/s = completion tokens of all requests / wall time. The
server's /v1/stats is read before and after, so the report carries the
rounds, the target's multi-sequence decodes and the mean actor hop (ms) of
the run (distributed mode). Meant to be called by `specray bench --url`.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

import httpx


def _one(client: httpx.Client, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True} | extra
    t0 = time.perf_counter()
    ttft = None
    usage = spec = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            if ttft is None:
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                usage, spec = obj["usage"], obj.get("speculative")
    return {"seconds": time.perf_counter() - t0, "ttft": ttft, "tokens": (usage or {}).get("completion_tokens", 0),
            "speculative": spec}


def run(url: str, prompts: list[str], concurrency: int, max_tokens: int = 128, extra: dict | None = None,
        timeout: float = 600) -> dict:
    """Stream every prompt (as a chat user message) with `concurrency` clients; aggregate figures."""
    url = url.rstrip("/")
    work: queue.Queue = queue.Queue()
    for p in prompts:
        work.put(p)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            while True:
                try:
                    p = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    res = _one(c, [{"role": "user", "content": p}], max_tokens, extra or {})
                    with lock:
                        results.append(res)
                except Exception as e:
                    with lock:
                        errors.append(str(e))

    with httpx.Client(base_url=url, timeout=60) as c:
        before = c.get("/v1/stats").json()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    with httpx.Client(base_url=url, timeout=60) as c:
        after = c.get("/v1/stats").json()
    tokens = sum(r["tokens"] for r in results)
    rounds = after["scheduler"]["rounds"] - before["scheduler"]["rounds"]
    out = {
        "url": url, "mode": after.get("mode"), "concurrency": concurrency, "requests": len(results),
        "errors": errors, "completion_tokens": tokens, "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "mean_ttft_s": round(sum(r["ttft"] or 0 for r in results) / max(1, len(results)), 3),
        "rounds": rounds,
        "round_ms": round(1000 * (after["scheduler"]["round_seconds"] - before["scheduler"]["round_seconds"])
                          / max(1, rounds), 2),
        "target_ms_per_round": round(1000 * (after["scheduler"]["target_seconds"]
                                             - before["scheduler"]["target_seconds"]) / max(1, rounds), 2),
        "multi_seq_decodes": after["target"]["multi_seq_decodes"] - before["target"]["multi_seq_decodes"],
    }
    if "hop" in after:
        h0, h1 = before["hop"], after["hop"]
        calls = h1["calls"] - h0["calls"]
        total = h1["mean_ms"] * h1["calls"] - h0["mean_ms"] * h0["calls"]
        out["hop_ms_per_round"] = round(total / calls, 3) if calls else None
        out["hop_p50_ms_recent"] = round(h1["p50_ms_recent"], 3)
    drafted = sum((r["speculative"] or {}).get("drafted_tokens", 0) for r in results)
    accepted = sum((r["speculative"] or {}).get("accepted_tokens", 0) for r in results)
    out["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="server base URL (without /v1)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", default=None, help="JSONL (prompt/messages/turns), default: Spec-Bench questions")
    ap.add_argument("--n", type=int, default=16, help="prompts per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from .bench import default_prompts_path, load_prompts

    bps = load_prompts(args.prompts or default_prompts_path(), None, 2)  # spread over categories
    prompts = [bp.prompt or bp.messages[-1]["content"] for bp in bps][: args.n]
    for c in args.concurrency:
        print(json.dumps(run(args.url, prompts, c, args.max_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
