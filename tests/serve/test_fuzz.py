"""Fuzzing the request schema over real HTTP (hypothesis): no input produces a 5xx.

Bodies are drawn around the OpenAI schema: every field sometimes valid,
sometimes of the wrong type or out of range (huge and negative integers,
NaN / Infinity, lone surrogates, nested junk), plus unknown fields, plus raw
byte and text bodies. Whatever comes in, the answer is a 200 with a
completion or a 4xx with OpenAI's error body; a stream never carries a
server error. Generation is kept short (max_tokens is always small when
valid) so the run stays bounded.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import AUTH

pytestmark = [pytest.mark.serve, pytest.mark.model]

EXAMPLES = 150

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_text = st.text(max_size=40)  # includes lone surrogates: JSON-escaped, decoded by the server
ints = st.integers(-3, 3) | st.integers(-(2 ** 70), 2 ** 70)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-1, 3)


def either(valid, invalid=junk):
    return st.one_of(valid, valid, invalid)


message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), small_text)},
    optional={"content": either(small_text | st.none() | st.lists(st.fixed_dictionaries(
        {"type": either(st.just("text"), small_text)}, optional={"text": either(small_text)}), max_size=2)),
        "name": either(small_text)},
)
common = {
    # always present: a valid request never generates more than 4 tokens
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(1, 4), ints, junk.filter(lambda v: v is not None)),
}
optional = {
    "model": either(small_text),
    "temperature": either(st.floats(0, 2), floats),
    "top_p": either(st.floats(0.01, 1), floats),
    "top_k": either(st.integers(0, 100), ints),
    "min_p": either(st.floats(0, 1), floats),
    "repeat_penalty": either(st.floats(0.5, 2), floats),
    "seed": either(ints),
    "stop": either(small_text | st.lists(small_text, max_size=3) | st.none()),
    "n": either(st.just(1), ints),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": either(st.booleans()),
    "speculative": either(st.fixed_dictionaries({}, optional={
        "enabled": either(st.booleans()),
        "chain": either(st.sampled_from(["ngram_mod", "suffix", "ngram_mod,suffix", "none", "", "bogus", "none,suffix"])
                        | st.lists(st.sampled_from(["ngram_simple", "suffix", "x"]), max_size=3)),
        "n_max": either(st.integers(0, 16), ints)})),
    "logprobs": either(st.booleans() | st.none() | st.integers(0, 25)),
    "top_logprobs": either(st.integers(0, 25), ints),
    "presence_penalty": either(st.floats(-2, 2), floats),
    "frequency_penalty": either(st.floats(-2, 2), floats),
    "logit_bias": either(st.dictionaries(st.sampled_from(["0", "17", "49151", "49152", "-1", "x", "1e3"]),
                                         st.floats(-150, 150) | floats, max_size=3)),
    "user": either(small_text),
    "unknown_field": junk,
}
completion = st.fixed_dictionaries(
    common | {"prompt": either(small_text.filter(bool) | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
                               | st.lists(small_text, max_size=2) | st.lists(ints, max_size=3))}, optional=optional)
chat = st.fixed_dictionaries(
    common | {"messages": either(st.lists(message, min_size=1, max_size=3))},
    optional=optional | {"max_completion_tokens": st.one_of(st.integers(1, 4), ints, junk)
                         .filter(lambda v: v is not None)})


def body_strategy():
    def dumps(d):
        return json.dumps(d, allow_nan=True).encode("utf-8", "surrogatepass")

    as_json = st.one_of(
        st.tuples(st.just("/v1/completions"), completion.map(dumps)),
        st.tuples(st.just("/v1/chat/completions"), chat.map(dumps)),
        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), junk.map(dumps)),
    )
    raw = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                    st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
    return st.one_of(as_json, as_json, as_json, raw)


@pytest.fixture(scope="module")
def http(rel_server):
    with httpx.Client(base_url=rel_server, timeout=120, headers=AUTH) as c:
        yield c


def check(http: httpx.Client, path: str, body: bytes, seen: dict) -> None:
    with http.stream("POST", path, content=body, headers={"Content-Type": "application/json"}) as r:
        data = r.read()
    seen[r.status_code] = seen.get(r.status_code, 0) + 1
    assert r.status_code < 500, (path, body[:300], r.status_code, data[:300])
    if r.status_code != 200:
        err = json.loads(data)["error"]
        assert 400 <= r.status_code < 500 and err["message"] and err["type"] != "server_error", err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e[6:] for e in data.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), (body[:300], e)
    else:
        assert json.loads(data)["choices"], data[:300]


def test_no_request_body_yields_a_5xx(http):
    seen: dict = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body_strategy())
    def run(case):
        path, body = case
        check(http, path, body, seen)

    run()
    print(f"\nfuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0
    st_ = http.get("/v1/stats").json()
    assert st_["round_failures"] == 0
