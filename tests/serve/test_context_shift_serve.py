"""Context shift over HTTP (the shared colocated app: exact mode, 512 cells per slot): a request that asks for
it runs past its context with the same greedy text with speculation on and off; without it, the same request
is refused before any model work, as before."""

from __future__ import annotations

import httpx
import pytest

from .conftest import AUTH, kv_is_only_the_cache

pytestmark = [pytest.mark.serve, pytest.mark.model]

PROMPT = "Count from one to one thousand in words, one number per line."
MAX_TOKENS = 560  # past the 512 cells of a slot: one shift


@pytest.fixture(scope="module")
def http(rel_server):
    with httpx.Client(base_url=rel_server, timeout=300, headers=AUTH) as c:
        yield c


def _complete(http, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                               "temperature": 0, "ignore_eos": True} | extra)


def test_shifted_request_is_lossless_over_http(http):
    before = http.get("/v1/stats").json()["scheduler"]["context_shifts"]
    on = _complete(http, context_shift=True)
    off = _complete(http, context_shift=True, speculative={"enabled": False})
    assert on.status_code == 200 and off.status_code == 200, (on.text, off.text)
    a, b = on.json(), off.json()
    assert a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == MAX_TOKENS
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    st = http.get("/v1/stats").json()
    assert st["scheduler"]["context_shifts"] >= before + 2  # each of the two shifted
    assert kv_is_only_the_cache(st)  # a shifted sequence leaves only its kept front to the prompt cache


def test_without_context_shift_the_request_must_fit(http):
    r = _complete(http)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = _complete(http, context_shift=True, n_keep=-2)  # validated like llama-server's fields
    assert r.status_code == 400
