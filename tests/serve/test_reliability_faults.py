"""Actor faults in the distributed deployment (real Ray, real HTTP): kill the companion, kill the target.

The companion's death costs model drafts only: every request completes with
its solo greedy output, the companion is recreated, /health says `degraded`
meanwhile. The target's death fails the requests running on it with a clear
503 (an error event in a stream), queued requests wait for the new actor,
/health says 503 `recovering` until it is back, and new requests are served
exactly again. Also here (this app truncates over-long prompts): truncation
is said in the response.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import ray

from specray.deployments.actors.supervisor import ActorSupervisor
from specray.deployments.actors.companion import CompanionActor
from specray.deployments.actors.companion_client import CompanionClient
from specray.deployments.actors.launch import ACTOR_NAMESPACE

from .conftest import (
    CHAT_PROMPTS,
    COMPLETION_PROMPTS,
    CONCURRENT_MAX_TOKENS,
    ENGINE,
    MAX_TOKENS,
    concurrent_prompts,
    deployed_app,
    kv_is_only_the_cache,
)

pytestmark = [pytest.mark.serve, pytest.mark.model]

N_CTX_SEQ = ENGINE["n_ctx"] // ENGINE["slots"]


@pytest.fixture(scope="module")
def faults(ray_serve):
    with deployed_app(ray_serve, "faults", {"mode": "distributed", "engine": ENGINE, "prompt_overflow": "truncate",
                                            "watchdog_interval_s": 0.5, "actor_ping_timeout_s": 5.0}) as base:
        yield base


@pytest.fixture(scope="module")
def http(faults):
    with httpx.Client(base_url=faults, timeout=300) as c:
        yield c


def stats(http) -> dict:
    r = http.get("/v1/stats")
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(pred, timeout: float, every: float = 0.1):
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v or time.time() > deadline:
            return v
        time.sleep(every)


def actor(name: str):
    return ray.get_actor(name, namespace=ACTOR_NAMESPACE)


# ---- truncation (prompt_overflow: truncate) ---------------------------------------------------------------
def test_overlong_prompt_is_truncated_and_said_so(http):
    prompt = "hello " * (N_CTX_SEQ + 100)
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    room = N_CTX_SEQ - 8 - ENGINE["chain"]["n_max"] - 1
    assert usage["prompt_tokens"] == room and usage["truncated_prompt_tokens"] > 100
    assert r.headers["x-specray-prompt-truncated"] == str(usage["truncated_prompt_tokens"])
    assert usage["completion_tokens"] == 8
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and int(s.headers["x-specray-prompt-truncated"]) > 100
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["truncated_prompt_tokens"] == int(s.headers["x-specray-prompt-truncated"])
    # max_tokens alone beyond the context is still an error: nothing to truncate
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": N_CTX_SEQ})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


# ---- companion --------------------------------------------------------------------------------------------
def test_companion_client_degrades_and_recovers(ray_serve):
    """The generic path every companion call takes: death or error -> default answer, restart, back."""

    def create(gen):
        name = f"test-companion:{gen}"
        return CompanionActor.options(name=name, namespace=ACTOR_NAMESPACE, num_cpus=0).remote(
            ENGINE | {"calibrate": False}), name

    sup = ActorSupervisor("companion", create, lambda h, n: ray.get(h.info.remote(), timeout=120) | {"actor_name": n},
                          backoff_s=0.2)
    sup.start()
    client = CompanionClient(sup, timeout_s=30)
    try:
        pid1 = client.call("info")["pid"]
        assert client.call("ping") == "ok" and client.calls == 2 and client.errors == 0
        ray.kill(actor("test-companion:1"))
        # (ray.kill is asynchronous) the call fails inside the client: the default comes back, no exception
        assert wait_for(lambda: client.call("ping", default="no answer") == "no answer", 60)
        assert client.errors == 1 and sup.failures == 1 and sup.state == "down"  # restarting takes seconds
        assert client.call("ping", default="skipped") == "skipped" and client.skipped == 1  # down: not called
        assert sup.wait_up(120) and sup.epoch == 2 and sup.restarts == 1
        assert client.up and client.call("info")["pid"] not in (None, pid1)  # a new companion process
        # an erroring companion (the call raises inside the actor) is replaced as well
        assert client.call("info", "unexpected argument", default="fallback") == "fallback"
        assert client.errors == 2 and sup.failures == 2
        assert sup.wait_up(120) and sup.epoch == 3 and client.call("ping") == "ok"
        assert sup.snapshot()["state"] == "up" and sup.snapshot()["restarts"] == 2
    finally:
        sup.close()


def _chat(base: str, prompt: str, max_tokens: int, stream: bool):
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content
    parts = []
    for ch in c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=0, stream=True):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
    return "".join(parts)


def _run_all(fns: list) -> dict:
    out: dict = {}

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    return out, threads


def test_kill_companion_mid_load_requests_complete_exactly(faults, http, reference):
    st0 = stats(http)
    comp0 = st0["companion"]
    assert comp0["state"] == "up" and comp0["generation"] == 1
    prompts = concurrent_prompts()
    out, threads = _run_all([lambda p=p, i=i: _chat(faults, p, CONCURRENT_MAX_TOKENS, stream=i % 2 == 0)
                             for i, p in enumerate(prompts)])
    assert wait_for(lambda: stats(http)["active"] > 0, 60)
    ray.kill(actor(comp0["name"]))
    t_kill = time.time()
    seen = set()

    def restarted():
        h = http.get("/health")
        seen.add((h.status_code, h.json()["status"]))
        return h.json()["companion"]["generation"] == 2 and h.json()["companion"]["state"] == "up"

    assert wait_for(restarted, 120), http.get("/health").json()
    t_back = time.time() - t_kill
    for t in threads:
        t.join(timeout=600)
    for i, p in enumerate(prompts):
        assert out[i] == reference[("chat", p, CONCURRENT_MAX_TOKENS)][0], f"request {i}: {out[i]!r}"
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["companion"]["restarts"] == 1 and h["companion"]["failures"] == 1
    assert h["companion"]["pid"] != comp0["pid"]
    # the health endpoint never reported the target down for a companion death (200 throughout)
    assert all(code == 200 for code, _ in seen) and {s for _, s in seen} <= {"ok", "degraded"}
    st = stats(http)
    assert st["companion"]["state"] == "up" and "calls" in st["companion"]  # the new companion answers
    assert st["target"]["generation"] == 1 and st["round_failures"] == 0
    print(f"\ncompanion killed: back after {t_back:.1f}s; health seen {sorted(seen)}")


# ---- target -----------------------------------------------------------------------------------------------------
def _sse_events(base: str, body: dict, started: threading.Event) -> list:
    events = []
    with httpx.Client(base_url=base, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) >= 3:
                    started.set()
    return events


def test_kill_target_mid_requests_503_then_recovers(faults, http, reference):
    st0 = stats(http)
    tgt0 = st0["target"]
    assert tgt0["state"] == "up"
    long = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "speculative": {"enabled": False}}
    started = [threading.Event() for _ in range(3)]
    fns = [lambda ev=ev: _sse_events(faults, long | {"stream": True}, ev) for ev in started]
    # a non-streamed request in the 4th slot, and two queued behind the full slots
    fns.append(lambda: httpx.post(f"{faults}/v1/chat/completions", json=long, timeout=300))
    queued = [COMPLETION_PROMPTS[0], CHAT_PROMPTS[0]]
    fns.append(lambda: httpx.post(f"{faults}/v1/completions", timeout=300,
                                  json={"prompt": queued[0], "max_tokens": MAX_TOKENS, "temperature": 0}))
    fns.append(lambda: _chat(faults, queued[1], MAX_TOKENS, stream=False))
    out, threads = _run_all(fns[:4])
    assert all(ev.wait(120) for ev in started)
    assert wait_for(lambda: stats(http)["active"] == 4, 60)
    out2, threads2 = _run_all(fns[4:])
    assert wait_for(lambda: stats(http)["queued"] == 2, 60)

    ray.kill(actor(tgt0["name"]))
    t_kill = time.time()
    health = []

    def recovered():
        h = http.get("/health")
        health.append((h.status_code, h.json()["status"], h.headers.get("retry-after")))
        return h.status_code == 200 and h.json()["target"]["generation"] == 2

    # right after the kill: a new request is refused with 503 + Retry-After (or served, if the actor is back)
    r = http.post("/v1/completions", json={"prompt": COMPLETION_PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "target_unavailable" and r.headers["retry-after"]
    assert wait_for(recovered, 180), health[-3:]
    t_back = time.time() - t_kill
    for t in threads + threads2:
        t.join(timeout=600)

    # the running streams: an error event (OpenAI error body, 503 code), then [DONE]
    for i in range(3):
        ev = out[i]
        assert not isinstance(ev, Exception), ev
        assert ev[-1] == "[DONE]", ev[-3:]
        err = json.loads(ev[-2])["error"]
        assert err["code"] == "target_unavailable" and err["type"] == "server_error", err
    # the running non-streamed request: a 503 with OpenAI's error body and Retry-After
    r = out[3]
    assert r.status_code == 503 and r.json()["error"]["code"] == "target_unavailable", r.text
    assert r.headers["retry-after"]
    # the queued requests never reached the dead actor: served by the new one, exactly
    r = out2[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[("completion", queued[0], MAX_TOKENS)][0]
    assert out2[1] == reference[("chat", queued[1], MAX_TOKENS)][0]
    # /health said so while the actor was being replaced
    assert any(code == 503 and status == "recovering" and ra for code, status, ra in health), health
    st = stats(http)
    assert st["target"]["state"] == "up" and st["target"]["generation"] == 2 and st["target"]["restarts"] == 1
    assert st["reliability"]["failed_target_lost"] == 4
    # the new actor holds exactly what the prompt cache records (the queued requests it served since): the
    # records of the lost actor's cells were dropped, or they would name cells the new actor does not have
    assert st["active"] == 0 and st["queued"] == 0 and kv_is_only_the_cache(st), (st["target"], st["prompt_cache"])
    # new requests succeed, exactly
    c = openai.OpenAI(base_url=f"{faults}/v1", api_key="none", timeout=300, max_retries=0)
    for p in COMPLETION_PROMPTS:
        r = c.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == reference[("completion", p, MAX_TOKENS)][0]
    print(f"\ntarget killed: back after {t_back:.1f}s; health seen {sorted(set(health))}")
