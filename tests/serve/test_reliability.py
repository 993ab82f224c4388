"""Reliability over real HTTP (colocated app `rel`, API key on): bad input, auth, cancellation, overload.

Every answer to a bad request is a 4xx with OpenAI's error body, never a 500
or a hang; a client that hangs up frees its slot and KV cells within a round;
beyond slots + queue the server says 429 with Retry-After; without the key
nothing but /health answers, and no model work is done.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

from .conftest import API_KEY, AUTH, CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, REL_ENGINE, REL_MAX_BODY
from .conftest import kv_is_only_the_cache

pytestmark = [pytest.mark.serve, pytest.mark.model]

N_CTX_SEQ = REL_ENGINE["n_ctx"] // REL_ENGINE["slots"]  # exact mode: one KV stream per slot


@pytest.fixture(scope="module")
def http(rel_server):
    with httpx.Client(base_url=rel_server, timeout=120, headers=AUTH) as c:
        yield c


def stats(http) -> dict:
    r = http.get("/v1/stats")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http, timeout: float = 60) -> dict:
    """Stats once no slot is busy, nothing is queued and every slot's KV cells are what its prompt cache holds."""
    deadline = time.time() + timeout
    while True:
        st = stats(http)
        idle = (st["active"] == 0 and st["queued"] == 0 and st["streams"] == 0
                and st["free_slots"] == st["slots"] and kv_is_only_the_cache(st))
        if idle or time.time() > deadline:
            return st
        time.sleep(0.2)


def assert_openai_error(r: httpx.Response, status: int, words: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert words.lower() in err["message"].lower(), err
    return err


# ---- raw HTTP (a client that really drops its connection) ------------------------------------------------
def open_stream(base: str, path: str, body: dict, key: str = API_KEY) -> socket.socket:
    u = urlparse(base)
    s = socket.create_connection((u.hostname, u.port), timeout=120)
    data = json.dumps(body).encode()
    head = (f"POST {u.path}{path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    s.sendall(head.encode() + data)
    return s


def read_events(s: socket.socket, n: int, timeout: float = 120) -> bytes:
    """Read until n SSE `data:` events arrived (or the stream ended)."""
    buf = b""
    s.settimeout(timeout)
    while buf.count(b"data: ") < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def long_stream_body(max_tokens: int = 300) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "speculative": {"enabled": False}}


# ---- auth --------------------------------------------------------------------------------------------------
def test_api_key_required_everywhere_but_health(rel_server, http):
    before = stats(http)["scheduler"]
    with httpx.Client(base_url=rel_server, timeout=60) as anon:
        assert anon.get("/health").status_code == 200  # probes need no key
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        for method, path, headers in [
            ("GET", "/v1/models", {}),
            ("GET", "/v1/stats", {}),
            ("POST", "/v1/completions", {}),
            ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong-key"}),
            ("POST", "/v1/completions", {"Authorization": f"Basic {API_KEY}"}),
            ("POST", "/v1/completions", {"Authorization": "Bearer"}),
            ("GET", "/docs", {}),
            ("GET", "/openapi.json", {}),
            ("GET", "/no/such/path", {}),
        ]:
            r = anon.request(method, path, json=body if method == "POST" else None, headers=headers)
            err = assert_openai_error(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", (path, err)
        # streamed requests too, and the official client maps it to AuthenticationError
        r = anon.post("/v1/completions", json=body | {"stream": True}, headers={"Authorization": "Bearer nope"})
        assert_openai_error(r, 401, "invalid api key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{rel_server}/v1", api_key="wrong", max_retries=0).completions.create(
            model="smollm2-135m", prompt="hi", max_tokens=2)
    after = stats(http)["scheduler"]
    assert after["rounds"] == before["rounds"] and after["tokens_emitted"] == before["tokens_emitted"]  # no work
    # with the key: served
    r = openai.OpenAI(base_url=f"{rel_server}/v1", api_key=API_KEY, max_retries=0).completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


# ---- bad input ---------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
TOO_LONG = "hello " * (N_CTX_SEQ + 50)

BAD = [
    # (path, body: str | bytes | dict, extra headers, status, words in the message)
    (COMP, "{not json", {}, 400, "malformed json"),
    (CHAT, '{"messages": [', {}, 400, "malformed json"),
    (COMP, "[1, 2, 3]", {}, 400, "invalid request"),
    (COMP, "null", {}, 400, ""),
    (COMP, '"a string"', {}, 400, ""),
    (COMP, '{"prompt": "hi", "max_tokens": 4}', {"Content-Type": "text/plain"}, 400, ""),
    (COMP, b'{"prompt": "caf\xe9 \xff\xfe"}', {}, 400, "utf-8"),
    (COMP, b"\x80\x81\x82", {}, 400, "utf-8"),
    (COMP, {"max_tokens": 5}, {}, 400, "prompt"),
    (CHAT, {"max_tokens": 5}, {}, 400, "messages"),
    (CHAT, {"messages": []}, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, {}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, {}, 400, "role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400, "image_url"),
    (COMP, {"prompt": ""}, {}, 400, "empty"),
    (COMP, {"prompt": []}, {}, 400, "empty"),
    (COMP, {"prompt": 5}, {}, 400, "prompt"),
    (COMP, {"prompt": ["a", "b"]}, {}, 400, "one prompt"),
    (COMP, {"prompt": [1, -5]}, {}, 400, "token ids"),
    (COMP, {"prompt": [10 ** 30]}, {}, 400, "token ids"),
    (COMP, {"prompt": [1, 99_999_999]}, {}, 400, "token ids"),
    (COMP, '{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}', {}, 400, "unicode"),
    (COMP, {"prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": -1}, {}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": "ten"}, {}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": 2.5}, {}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": N_CTX_SEQ + 1}, {}, 400, "context"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10 ** 12}, {}, 400, "context"),
    (COMP, {"prompt": "hi", "temperature": -0.5}, {}, 400, "temperature"),
    (COMP, {"prompt": "hi", "temperature": "hot"}, {}, 400, "temperature"),
    (COMP, '{"prompt": "hi", "temperature": NaN}', {}, 400, "temperature"),
    (COMP, '{"prompt": "hi", "repeat_penalty": Infinity}', {}, 400, "repeat_penalty"),
    (COMP, {"prompt": "hi", "top_p": 0}, {}, 400, "top_p"),
    (COMP, {"prompt": "hi", "n": 99}, {}, 400, "n must be in"),
    (COMP, {"prompt": "hi", "grammar": "root ::= nope"}, {}, 400, "does not compile"),
    (COMP, {"prompt": "hi", "stream": "maybe"}, {}, 400, "stream"),
    (COMP, {"prompt": "hi", "stop": ["x"] * 17}, {}, 400, "stop"),
    (COMP, {"prompt": "hi", "stop": [1, 2]}, {}, 400, "stop"),
    (COMP, {"prompt": "hi", "speculative": {"chain": "ngram_mod,warp_drive"}}, {}, 400, "unknown speculator"),
    (COMP, {"prompt": "hi", "speculative": {"chain": ["nope"]}, "stream": True}, {}, 400, "unknown speculator"),
    (COMP, {"prompt": "hi", "speculative": {"chain": "none,suffix"}}, {}, 400, "none"),
    (COMP, {"prompt": "hi", "speculative": {"chain": "ngram_mod,draft"}}, {}, 400, "draft"),  # no draft model
    (COMP, {"prompt": "hi", "speculative": {"n_max": -1}}, {}, 400, "n_max"),
    (COMP, {"prompt": "hi", "speculative": {"n_max": 10 ** 6}}, {}, 400, "n_max"),
    (COMP, {"prompt": "hi", "speculative": {"warp": 9}}, {}, 400, "warp"),
    (COMP, {"prompt": "hi", "speculative": "fast"}, {}, 400, "speculative"),
    (COMP, {"prompt": "hi", "max_tokens": 2}, {"X-Specray-Arm": "b"}, 400, "unknown arm"),
    (CHAT, {"messages": MSG, "max_tokens": 2, "stream": True}, {"X-Specray-Arm": "experimental"}, 400,
     "unknown arm"),
    (COMP, {"prompt": TOO_LONG, "max_tokens": 8}, {}, 400, "context"),
    (COMP, {"prompt": TOO_LONG, "max_tokens": 8, "stream": True}, {}, 400, "context"),
    (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 8}, {}, 400, "context"),
    (COMP, {"prompt": "x" * (REL_MAX_BODY + 10)}, {}, 413, "too large"),
    (COMP, b"[" * 50_000, {}, 400, ""),  # deep nesting: the parser's recursion limit, not a 500
    ("/v1/nope", {}, {}, 404, "not found"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_) in
                                                        enumerate(BAD)])
def test_bad_input_is_a_clear_4xx(http, case):
    path, body, headers, status, words = BAD[case]
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    r = http.post(path, content=body, headers={"Content-Type": "application/json"} | headers)
    err = assert_openai_error(r, status, words)
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}[status]


def test_accepted_edge_values_and_known_arm(http):
    """Values at the edge of valid are served (and not mistaken for errors)."""
    ok = [
        {"prompt": "The capital of France is", "max_tokens": 2, "seed": -7, "temperature": 0.7},
        {"prompt": "The capital of France is", "max_tokens": 2, "seed": 2 ** 80},
        {"prompt": [504, 3575, 282], "max_tokens": 2, "temperature": 0},
        {"prompt": "Caf\u00e9 \u2603 \U0001f600", "max_tokens": 2, "temperature": 0},
        {"prompt": "nul \u0000 byte", "max_tokens": 2, "temperature": 0},
        {"prompt": "hi", "max_tokens": 2, "stop": [], "top_k": 10 ** 12, "repeat_penalty": 1e6},
        {"prompt": "hi", "max_tokens": 2, "unknown_openai_field": {"x": 1}, "user": "u1"},
    ]
    for body in ok:
        r = http.post(COMP, json=body, headers={"X-Specray-Arm": "default"})
        assert r.status_code == 200, (body, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                              "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_server_keeps_serving_exactly_after_bad_input(http, reference):
    prompt = COMPLETION_PROMPTS[0]
    text, _, _ = reference[("completion", prompt, MAX_TOKENS)]
    r = http.post(COMP, json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    st = wait_idle(http)
    assert st["round_failures"] == 0 and st["free_slots"] == st["slots"]


# ---- cancellation --------------------------------------------------------------------------------------------
def _chat_stream(http_base: str, prompt: str, out: dict, key: int) -> None:
    try:
        c = openai.OpenAI(base_url=f"{http_base}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        parts = []
        for ch in c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
        out[key] = "".join(parts)
    except Exception as e:  # reported by the assertion
        out[key] = e


def test_disconnect_mid_stream_frees_slot_and_kv_others_unaffected(rel_server, http, reference):
    st0 = wait_idle(http)
    rel0 = st0["reliability"]
    socks = [open_stream(rel_server, CHAT, long_stream_body()) for _ in range(2)]
    for s in socks:
        head = read_events(s, 3)  # decoding: the slot is taken and its KV cache holds the sequence
        assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
    mid = stats(http)
    # the two running sequences' slots hold cells the prompt cache does not own
    grown = [c > k for c, k in zip(mid["target"]["kv_cells"], mid["prompt_cache"]["cached_cells"])]
    assert mid["active"] == 2 and sum(grown) == 2, (mid["target"], mid["prompt_cache"])
    # two well-behaved streams run alongside; one dropped connection must not disturb them
    out: dict = {}
    others = [threading.Thread(target=_chat_stream, args=(rel_server, p, out, i)) for i, p in enumerate(CHAT_PROMPTS)]
    for t in others:
        t.start()
    time.sleep(0.5)
    for s in socks:
        s.close()  # hang up mid-stream (the server only learns it from the socket)
    t_close = time.time()
    st = wait_idle(http, 60)
    freed_after = time.time() - t_close
    for t in others:
        t.join(timeout=300)
    for i, p in enumerate(CHAT_PROMPTS):
        assert out.get(i) == reference[("chat", p, MAX_TOKENS)][0], f"stream {i}: {out.get(i)!r}"
    rel = st["reliability"]
    assert st["active"] == 0 and st["free_slots"] == st["slots"], st
    assert kv_is_only_the_cache(st), st["target"]  # the dropped sequences' cells are gone or the cache's
    assert rel["cancelled"] - rel0["cancelled"] == 2, rel
    assert rel["cancel_rounds_max"] <= 1, rel  # applied at the top of the next round
    emitted = st["scheduler"]["tokens_emitted"] - st0["scheduler"]["tokens_emitted"]
    assert emitted < 2 * 300, emitted  # the dropped streams did not run to max_tokens
    print(f"\ndisconnect: slots and KV free {freed_after:.2f}s after the sockets closed; {rel}")


def test_disconnect_of_non_streamed_request_frees_slot(rel_server, http):
    wait_idle(http)
    c0 = stats(http)["reliability"]["cancelled"]
    body = long_stream_body(400) | {"stream": False}
    s = open_stream(rel_server, CHAT, body)
    deadline = time.time() + 60
    while stats(http)["active"] == 0 and time.time() < deadline:
        time.sleep(0.1)
    s.close()
    st = wait_idle(http, 60)
    assert st["active"] == 0 and kv_is_only_the_cache(st), st
    assert st["reliability"]["cancelled"] == c0 + 1


# ---- overload ------------------------------------------------------------------------------------------------
def test_overload_gets_429_with_retry_after_then_recovers(rel_server, http):
    slots, queue = REL_ENGINE["slots"], REL_ENGINE["max_queue"]
    wait_idle(http)
    socks = [open_stream(rel_server, CHAT, long_stream_body(200)) for _ in range(slots + queue)]
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            st = stats(http)
            if st["active"] == slots and st["queued"] == queue:
                break
            time.sleep(0.2)
        assert st["active"] == slots and st["queued"] == queue, (st["active"], st["queued"])
        for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
            t0 = time.perf_counter()
            r = http.post(COMP, json=body)
            err = assert_openai_error(r, 429, "busy")
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "2"
            assert time.perf_counter() - t0 < 10  # refused at once, not queued
        rejected = stats(http)["reliability"]["rejected_queue_full"]
        assert rejected >= 2
    finally:
        for s in socks:
            s.close()
    st = wait_idle(http, 120)
    assert st["active"] == 0 and st["queued"] == 0 and kv_is_only_the_cache(st), st
    r = http.post(COMP, json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
