"""logprobs, top_logprobs, presence/frequency penalties and logit_bias through the official `openai` client,
streamed and not, with speculation on and off (the shared colocated app: exact mode, so speculation must not
change a number)."""

from __future__ import annotations

import openai
import pytest

from .conftest import API_KEY, AUTH, CHAT_PROMPTS, COMPLETION_PROMPTS

pytestmark = [pytest.mark.serve, pytest.mark.model]

OFF = {"speculative": {"enabled": False}}
N = 24


@pytest.fixture(scope="module")
def client(rel_server):
    return openai.OpenAI(base_url=f"{rel_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _chat(client, extra=None, stream=False, **kw):
    args = dict(model="m", messages=[{"role": "user", "content": CHAT_PROMPTS[0]}], max_tokens=N, temperature=0,
                extra_body=extra or {}, **kw)
    if not stream:
        return client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    return text, content


def test_chat_logprobs_streamed_and_not_with_speculation_on_and_off(client):
    on = _chat(client, logprobs=True, top_logprobs=3)
    off = _chat(client, OFF, logprobs=True, top_logprobs=3)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.model_extra["speculative"]["accepted_tokens"] > 0 and off.model_extra["speculative"]["drafts"] == 0
    a, b = on.choices[0].logprobs.content, off.choices[0].logprobs.content
    assert len(a) == on.usage.completion_tokens == len(b)
    assert [(e.token, e.logprob) for e in a] == [(e.token, e.logprob) for e in b]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in a)  # greedy: the top one
    assert all(e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token for e in a)
    assert "".join(e.token for e in a) == on.choices[0].message.content
    text, streamed = _chat(client, stream=True, logprobs=True, top_logprobs=3)
    assert text == on.choices[0].message.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in a]
    plain = _chat(client)
    assert plain.choices[0].logprobs is None  # not asked for


def test_completion_logprobs_streamed_and_not(client):
    args = dict(model="m", prompt=COMPLETION_PROMPTS[1], max_tokens=N, temperature=0, logprobs=2)
    r = client.completions.create(**args)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    off = client.completions.create(extra_body=OFF, **args)
    assert off.choices[0].logprobs.token_logprobs == lp.token_logprobs
    chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset


def test_penalties_and_logit_bias_with_speculation_on_and_off(client):
    from specray.native.model import Model

    plain = _chat(client, logprobs=True).choices[0]
    vocab = Model("smollm2-135m", vocab_only=True)
    banned = int(vocab.tokenize(plain.logprobs.content[0].token, add_special=False)[0])
    vocab.close()
    kw = dict(presence_penalty=0.5, frequency_penalty=0.8, logit_bias={str(banned): -100.0}, logprobs=True)
    on = _chat(client, **kw)
    off = _chat(client, OFF, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content != plain.message.content
    assert [e.logprob for e in on.choices[0].logprobs.content] == [e.logprob for e in off.choices[0].logprobs.content]
    assert on.choices[0].logprobs.content[0].token != plain.logprobs.content[0].token  # the ban held
    assert on.model_extra["speculative"]["drafts"] > 0


def test_bad_logprob_and_bias_fields_are_400s(rel_server):
    import httpx

    with httpx.Client(base_url=rel_server, timeout=60, headers=AUTH) as http:
        def post(body, path="/v1/chat/completions"):
            base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return http.post(path, json=base | body)

        for body, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                            ({"top_logprobs": 2}, "top_logprobs"),
                            ({"logit_bias": {"abc": 1}}, "logit_bias"),
                            ({"logit_bias": {"5": 500}}, "logit_bias"),
                            ({"logit_bias": {"1000000": 1}}, "logit_bias"),
                            ({"presence_penalty": 3}, "presence_penalty")]:
            r = post(body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert param in (err.get("param") or "") + err["message"], (body, err)
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 21})
        assert r.status_code == 400 and "logprobs" in r.text


def test_completion_echo_with_logprobs(client):
    """lm-eval's loglikelihood request: echo + logprobs + 1 token. The prompt comes back with its tokens'
    logprobs (the first one null), and a prompt token's logprob is the one the model gives it when it is
    generated (exact mode)."""
    prompt = COMPLETION_PROMPTS[0]
    first = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    nxt, lp_next = first.choices[0].text, first.choices[0].logprobs.token_logprobs[0]
    r = client.completions.create(model="m", prompt=prompt + nxt, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True)
    c = r.choices[0]
    assert c.text.startswith(prompt + nxt)
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    prompt_last = lp.token_logprobs[r.usage.prompt_tokens - 1]
    assert abs(prompt_last - lp_next) < 1e-3, (prompt_last, lp_next)
    # streamed: the prompt in the first chunk, then the tokens
    chunks = [ch for ch in client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                                     echo=True, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks).startswith(prompt)
    assert chunks[0].choices[0].logprobs is None  # echo without logprobs: the text only
