"""Overlapped rounds behind HTTP (`engine.overlap`, colocated and distributed): each round's events reach their
streams while the next round decodes (the replica delivers them as the scheduler makes them), a client that hangs
up then is cancelled once the round is over, and the text is what the in-process engine gives without overlap."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from .conftest import CONCURRENT_MAX_TOKENS, ENGINE, MAX_TOKENS, concurrent_chats, concurrent_prompts, deployed_app
from .conftest import kv_is_only_the_cache
from .test_reliability import long_stream_body, open_stream, read_events

pytestmark = [pytest.mark.serve, pytest.mark.model]


@pytest.fixture(scope="module", params=["colocated", "distributed-actor", "distributed-compiled"])
def overlap_server(request, ray_serve):
    """An app with overlapped rounds: the target in the replica's process, or in a target actor reached by an
    actor call or a compiled graph (the round sent, the replica's work done while the actor decodes)."""
    mode, _, hop = request.param.partition("-")
    args = {"mode": mode, "engine": ENGINE | {"overlap": True}} | ({"target_hop": hop} if hop else {})
    with deployed_app(ray_serve, f"overlap-{request.param}", args) as base:
        yield base


def _stats(base: str) -> dict:
    r = httpx.get(f"{base}/v1/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(base: str, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        st = _stats(base)
        if (st["active"] == 0 and st["queued"] == 0 and st["free_slots"] == st["slots"] and kv_is_only_the_cache(st)) \
                or time.time() > deadline:
            return st
        time.sleep(0.2)


def test_streams_under_overlap_equal_the_engine_without_it(overlap_server, reference):
    prompts = concurrent_prompts()
    out = concurrent_chats(overlap_server, prompts)
    for i, p in enumerate(prompts):
        assert out[i] == reference[("chat", p, CONCURRENT_MAX_TOKENS)][0], f"stream {i}: {out[i]!r}"
    client = openai.OpenAI(base_url=f"{overlap_server}/v1", api_key="none", timeout=300, max_retries=0)
    p = "The capital of France is"
    r = client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
    text, n, _ = reference[("completion", p, MAX_TOKENS)]
    assert r.choices[0].text == text and r.usage.completion_tokens == n
    st = _wait_idle(overlap_server)
    assert 0 < st["scheduler"]["overlapped_rounds"] <= st["scheduler"]["rounds"]


def test_a_client_gone_mid_stream_is_cancelled_after_the_round(overlap_server):
    st0 = _wait_idle(overlap_server)
    socks = [open_stream(overlap_server, "/v1/chat/completions", long_stream_body()) for _ in range(2)]
    for s in socks:
        head = read_events(s, 3)
        assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
    for s in socks:
        s.close()
    st = _wait_idle(overlap_server)
    assert st["active"] == 0 and st["free_slots"] == st["slots"] and kv_is_only_the_cache(st), st
    assert st["reliability"]["cancelled"] - st0["reliability"]["cancelled"] == 2
    emitted = st["scheduler"]["tokens_emitted"] - st0["scheduler"]["tokens_emitted"]
    assert emitted < 2 * 300, emitted  # the dropped streams did not run to max_tokens
