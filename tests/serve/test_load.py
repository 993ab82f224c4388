"""Load test against the live `rel` app (loopback, bounded): 200 mixed requests at concurrency 16.

Mix: completions and chat, streamed and not, some cancelled mid-stream (the
client drops the connection), some malformed, some with a prompt over the
context. Every well-formed request must come back with exactly its solo
greedy output (exact mode), every bad one with its 4xx; afterwards no slot
is busy, no KV cell is held, and the replica's RSS grew by less than
RSS_BOUND. The figures are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import AUTH, REL_ENGINE, kv_is_only_the_cache, spec_bench_prompts
from .test_reliability import N_CTX_SEQ, stats, wait_idle

pytestmark = [pytest.mark.serve, pytest.mark.model]

N_REQUESTS = 200
CONCURRENCY = 16
MAX_TOKENS = 12
RSS_BOUND = 64 << 20  # replica RSS growth allowed over the run (bytes)
TIME_BOUND = 1800  # seconds for the whole run: a hang detector (niced next to a benchmark it took ~20 min)

COMPLETION = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
              "Copy this list exactly: red, green, blue, red, green, blue, red,", "1, 2, 3, 4, 5,",
              "The three laws of motion are"]
MALFORMED = [  # (body, status)
    ('{"prompt": "hi", "max_tokens": ', 400),
    (json.dumps({"prompt": "hi", "max_tokens": 0}), 400),
    (json.dumps({"prompt": "hi", "temperature": -1}), 400),
    (json.dumps({"max_tokens": 4}), 400),
    (json.dumps({"prompt": "hi", "speculative": {"chain": "nope"}}), 400),
    (json.dumps({"prompt": "hi", "stream": True, "max_tokens": "many"}), 400),
]
OVERLONG = json.dumps({"prompt": "hello " * (N_CTX_SEQ + 20), "max_tokens": 8})


def chat_prompts() -> list[str]:
    return spec_bench_prompts(6)


def plan(seed: int = 0) -> list[dict]:
    """The request mix, deterministic."""
    rng = random.Random(seed)
    kinds = (["completion"] * 30 + ["completion_stream"] * 15 + ["chat"] * 15 + ["chat_stream"] * 15
             + ["cancel"] * 10 + ["malformed"] * 8 + ["overlong"] * 7)
    out = []
    for i in range(N_REQUESTS):
        kind = rng.choice(kinds)
        item = {"i": i, "kind": kind}
        if kind.startswith("completion"):
            item["prompt"] = rng.choice(COMPLETION)
        elif kind.startswith("chat") or kind == "cancel":
            item["prompt"] = rng.choice(chat_prompts())
        elif kind == "malformed":
            item["body"], item["status"] = MALFORMED[i % len(MALFORMED)]
        out.append(item)
    return out


@pytest.fixture(scope="module")
def solo():
    """Solo greedy outputs of the in-process engine with the server's engine config."""
    from specray.deployments.local_engine import LocalEngine
    from specray.engine.config import EngineConfig

    eng = LocalEngine(EngineConfig.model_validate(REL_ENGINE))
    ref = {}
    for p in COMPLETION:
        ref[("completion", p)] = eng.generate(prompt=p, max_tokens=MAX_TOKENS).text
    for p in chat_prompts():
        ref[("chat", p)] = eng.generate(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS).text
    eng.close()
    return ref


def run_one(c: httpx.Client, item: dict, solo: dict) -> dict:
    kind = item["kind"]
    t0 = time.perf_counter()
    res = {"kind": kind, "ok": False, "status": None}
    try:
        if kind in ("malformed", "overlong"):
            body = item["body"] if kind == "malformed" else OVERLONG
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            want = item.get("status", 400)
            res["status"] = r.status_code
            res["ok"] = r.status_code == want and "message" in r.json().get("error", {})
        elif kind == "cancel":
            body = {"messages": [{"role": "user", "content": item["prompt"]}], "max_tokens": 200, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                res["status"] = r.status_code
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if n >= 2:
                        break  # hang up mid-stream
            res["ok"] = r.status_code == 200 and n >= 2
        else:
            chat = kind.startswith("chat")
            stream = kind.endswith("_stream")
            key = ("chat" if chat else "completion", item["prompt"])
            body = {"max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
            if chat:
                body["messages"] = [{"role": "user", "content": item["prompt"]}]
            else:
                body["prompt"] = item["prompt"]
            path = "/v1/chat/completions" if chat else "/v1/completions"
            if not stream:
                r = c.post(path, json=body)
                res["status"] = r.status_code
                if r.status_code == 200:
                    ch = r.json()["choices"][0]
                    text = ch["message"]["content"] if chat else ch["text"]
                    res["ok"] = text == solo[key]
                    if not res["ok"]:
                        res["text"], res["want"], res["usage"] = text, solo[key], r.json().get("usage")
                        res["prompt"] = item["prompt"]
            else:
                parts = []
                with c.stream("POST", path, json=body) as r:
                    res["status"] = r.status_code
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            res["error"] = ev["error"]
                            break
                        if ev.get("choices"):
                            ch = ev["choices"][0]
                            parts.append((ch["delta"].get("content") or "") if chat else ch["text"])
                res["ok"] = r.status_code == 200 and "error" not in res and "".join(parts) == solo[key]
                if not res["ok"]:
                    res["text"], res["want"], res["prompt"] = "".join(parts), solo[key], item["prompt"]
    except Exception as e:  # counted as a failure of its kind
        res["error"] = f"{type(e).__name__}: {e}"
    res["latency"] = time.perf_counter() - t0
    return res


def test_load_200_mixed_requests_at_concurrency_16(rel_server, solo):
    with httpx.Client(base_url=rel_server, timeout=300, headers=AUTH) as http:
        # warm-up, then the baseline RSS
        for p in COMPLETION[:2]:
            assert http.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}).status_code == 200
        st0 = wait_idle(http)
        rss0 = st0["process"]["rss_bytes"]
        items = plan()
        local = threading.local()

        def worker(item):
            if not hasattr(local, "c"):
                local.c = httpx.Client(base_url=rel_server, timeout=300, headers=AUTH)
            return run_one(local.c, item, solo)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(worker, items))
        wall = time.perf_counter() - t0
        st = wait_idle(http, 60)
        rss1 = st["process"]["rss_bytes"]

    kinds = Counter(r["kind"] for r in results)
    failures = Counter(r["kind"] for r in results if not r["ok"])
    lat = sorted(r["latency"] for r in results if r["kind"] not in ("malformed", "overlong", "cancel"))
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    rel = st["reliability"]
    tokens = st["scheduler"]["tokens_emitted"] - st0["scheduler"]["tokens_emitted"]
    print(f"\nload: {len(results)} requests at concurrency {CONCURRENCY} in {wall:.1f}s; kinds {dict(kinds)}")
    print(f"  failures by kind: {dict(failures) or 'none'}; statuses {dict(Counter(r['status'] for r in results))}")
    print(f"  latency of well-formed completed requests: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; "
          f"{tokens} tokens emitted")
    print(f"  slots at end: {st['free_slots']}/{st['slots']} free, active {st['active']}, queued {st['queued']}, "
          f"KV cells {st['target']['kv_cells']}; cancelled {rel['cancelled'] - st0['reliability']['cancelled']}, "
          f"429s {rel['rejected_queue_full'] - st0['reliability']['rejected_queue_full']}")
    print(f"  replica RSS: {rss0 / 2**20:.1f} MiB before, {rss1 / 2**20:.1f} MiB after "
          f"({(rss1 - rss0) / 2**20:+.1f} MiB; bound {RSS_BOUND / 2**20:.0f} MiB)")
    gc0, gc1 = st0["process"]["gc"], st["process"]["gc"]
    print(f"  garbage collector: {gc1['frozen']} start-up objects frozen; collections during the load by "
          f"generation {[b - a for a, b in zip(gc0['collections'], gc1['collections'])]}, "
          f"{gc1['ms'][2] - gc0['ms'][2]:.1f} ms in full ones")
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        print(f"  failed: {r}")
    assert not bad, bad[:5]
    assert st["active"] == 0 and st["queued"] == 0 and st["free_slots"] == st["slots"]
    assert kv_is_only_the_cache(st) and st["streams"] == 0
    assert st["round_failures"] == 0
    assert rel["cancelled"] - st0["reliability"]["cancelled"] == kinds["cancel"]
    assert rss1 - rss0 < RSS_BOUND
    assert gc1["frozen"] > 10_000  # the replica froze its start-up heap (ServeConfig.freeze_gc, on by default)
    assert wall < TIME_BOUND
