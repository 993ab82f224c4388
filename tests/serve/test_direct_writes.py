"""Direct writes (deployments/http/socket_sink.py) as a user meets them: `specray serve` with its own Ray, so
direct ingress is on and the engine replica holds the client's socket; the round thread then writes the plain
deltas itself. The official openai client and raw sockets as clients.

Exact mode and a speculating chain: streamed answers must equal the same server's non-streamed ones (which
never take the direct path), solo and with 8 streams on 4 slots, and /v1/stats must show the round thread
really wrote them. A reader that stops reading makes the socket take chunks only in part (the loop finishes
them: every byte once, in order); a client that goes away frees its slot.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time

import openai
import pytest

from specray.deployments.http.direct_response import SNDBUF_ENV

from .test_serve_command import _serve, _stop

pytestmark = [pytest.mark.serve, pytest.mark.model]

PROMPTS = ["Write a Python function that adds two numbers.", "Name three primary colors.",
           "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,",
           "Explain what a hash table is.", "Give me two tips for sleeping well.", "What is 17 times 23?",
           "Write a haiku about rain.", "List the planets of the solar system."]


@pytest.fixture(scope="module")
def server():
    tmp = tempfile.mkdtemp(prefix="srd", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": tmp}
    # a small send buffer per connection (direct_response.SNDBUF_ENV): a reader that stops reading fills it fast
    conf = os.path.join(tmp, "serve.yaml")
    with open(conf, "w") as f:
        f.write(f"worker_env: {{{SNDBUF_ENV}: '16384'}}\n")
    proc, port, lines = _serve(env, "--slots", "4", "--n-ctx", "4096", "--exact", "--spec", "ngram_mod,suffix",
                               "--threads", "2", "--config", conf)
    try:
        line = next(ln for ln in lines if "specray: serving" in ln)
        assert "direct ingress" in line, line
        yield port
    finally:
        _stop(proc)


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=180)


def _stats(port: int) -> dict:
    return _client(port).get("/stats", cast_to=object)


def _direct(port: int) -> dict:
    return _stats(port)["arms"]["default"]["direct_writes"]


def _chat(port: int, prompt: str, max_tokens: int = 48, stream: bool = True, target_only: bool = False) -> str:
    msgs = [{"role": "user", "content": prompt}]
    c = _client(port)
    if not stream:
        extra = {"speculative": {"enabled": False}} if target_only else None
        return c.chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, messages=msgs,
                                         extra_body=extra).choices[0].message.content
    chunks = c.chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, messages=msgs, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_streamed_answers_are_the_non_streamed_ones_and_the_round_thread_wrote_them(server):
    before = _direct(server)
    for p in PROMPTS[:2]:
        assert _chat(server, p) == _chat(server, p, stream=False)
    c = _client(server)
    prompt = "The capital of France is"
    whole = c.completions.create(model="m", prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    parts = c.completions.create(model="m", prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                 stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert chunks[-1].usage.completion_tokens > 0  # the end chunks still come through the event loop
    after = _direct(server)
    assert after["streams"] - before["streams"] == 3 and after["armed"] - before["armed"] == 3, (before, after)
    assert after["chunks"] - before["chunks"] >= 3


def test_eight_streams_on_four_slots_equal_target_only_output(server):
    """Speculation on, streamed through direct writes, 8 at once: each answer equals the target alone's
    (drafts off, not streamed; exact mode, so token for token)."""
    solo = {p: _chat(server, p, stream=False, target_only=True) for p in PROMPTS}
    got: dict[str, str] = {}

    def run(p: str) -> None:
        got[p] = _chat(server, p)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == solo


def _raw_stream(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    return s


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response; fails on any framing error."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        n = int(size_line, 16)
        if n == 0:
            assert rest == b"\r\n", rest[:80]
            return body
        body += rest[:n]
        assert rest[n:n + 2] == b"\r\n", rest[n:n + 40]
        rest = rest[n + 2:]


def _wait_idle(port: int, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = _stats(port)
        if st["active"] == 0 and st["queued"] == 0:
            return st
        time.sleep(0.2)
    pytest.fail("the server did not go idle")


def test_a_reader_that_stops_reading_gets_every_byte_in_order(server):
    """The client does not read until its whole answer is generated: the socket fills, the round thread's
    writes are taken only in part, and the loop writes the rest (raw items), then everything after it."""
    prompt, n = "Count from one to one hundred:", 300
    # no drafts: a chunk per token, ~70 KB in all
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "speculative": {"enabled": False}}
    whole = _client(server).completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                               extra_body={k: body[k] for k in ("ignore_eos", "speculative")}
                                               ).choices[0].text
    before = _direct(server)
    s = _raw_stream(server, body | {"stream": True}, rcvbuf=4096)
    with s:
        time.sleep(1.0)
        _wait_idle(server)  # generated in full while nobody read
        raw = b""
        s.settimeout(60)
        while not raw.endswith(b"0\r\n\r\n"):
            data = s.recv(65536)
            assert data, "the server closed the connection early"
            raw += data
    events = [json.loads(line[6:]) for line in _dechunk(raw).decode().split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole
    after = _direct(server)
    assert after["partial"] > before["partial"], (before, after)


def test_a_client_that_goes_away_frees_its_slot(server):
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    rel0 = _stats(server)["reliability"]["cancelled"]
    s = _raw_stream(server, body)
    s.settimeout(60)
    got = b""
    while got.count(b"data: ") < 4:  # the stream runs
        got += s.recv(4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    s.close()
    st = _wait_idle(server, timeout=30)  # well before 900 tokens
    assert st["reliability"]["cancelled"] > rel0
    assert _chat(server, PROMPTS[1], max_tokens=8)  # and the server goes on
