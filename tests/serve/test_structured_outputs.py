"""Structured outputs, tool calls and n > 1 through the official `openai` client, both deployment modes:
response_format json_schema (`chat.completions.parse`), json_object, llama-server's `grammar` extension, the
client's tool-call loop, n choices sharing the prompt's cells; streamed and not, with speculation (the grammar
speculator in the chain) and without; exact mode, so the text must not change. Bad grammars, schemas, tool
fields and n are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.serve, pytest.mark.model]

OFF = {"speculative": {"enabled": False}}
ON = {"speculative": {"chain": "ngram_mod,suffix,grammar"}}
TEXT = "Maria Gonzalez, 34, is a software engineer living in Madrid."
MESSAGES = [{"role": "user", "content": f"Extract the person (name, age, city) from the text as JSON.\n\n{TEXT}"}]


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def client(server):
    _, base = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)


def test_parse_with_a_schema_with_speculation_on_and_off(client):
    on = client.chat.completions.parse(model="m", messages=MESSAGES, response_format=Person, temperature=0,
                                       max_tokens=64, extra_body=ON)
    off = client.chat.completions.parse(model="m", messages=MESSAGES, response_format=Person, temperature=0,
                                        max_tokens=64, extra_body=OFF)
    assert on.choices[0].message.content == off.choices[0].message.content
    person = on.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 34, on.choices[0].message.content
    spec = on.model_extra["speculative"]
    assert spec["accepted_tokens"] > 0 and off.model_extra["speculative"]["drafts"] == 0
    # streamed: the same text, delta by delta
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=64, stream=True, extra_body=ON,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == on.choices[0].message.content


def test_json_object_and_a_gbnf_grammar(client):
    args = dict(model="m", messages=[{"role": "user", "content": "Give me a JSON object about a dog."}],
                temperature=0, max_tokens=96, response_format={"type": "json_object"})
    a = client.chat.completions.create(extra_body=ON, **args)
    b = client.chat.completions.create(extra_body=OFF, **args)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content
    assert text.lstrip().startswith("{")
    if a.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    g = {"grammar": 'root ::= ("yes" | "no") "!"'}
    r = client.completions.create(model="m", prompt="Is water wet? Answer:", max_tokens=6, temperature=0,
                                  extra_body=g | ON)
    assert r.choices[0].text in ("yes!", "no!")


def test_bad_grammars_and_schemas_are_400s(server):
    _, base = server
    with httpx.Client(base_url=base, timeout=60) as http:
        base_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for body, param in [({"grammar": "root ::= nothing_here"}, "grammar"),
                            ({"grammar": ""}, "grammar"),
                            ({"response_format": {"type": "xml"}}, "response_format"),
                            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                             "response_format"),
                            ({"response_format": {"type": "json_schema", "json_schema": {
                                "name": "x", "schema": {"properties": {"a": {"$ref": "#/nope"}}}}}},
                             "response_format"),
                            ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
                             "response_format")]:
            r = http.post("/v1/chat/completions", json=base_body | body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (body, err)
        ok = http.post("/v1/chat/completions", json=base_body | {"grammar": 'root ::= "ok"'})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_the_openai_clients_tool_call_loop(client):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    args = dict(model="m", tools=TOOLS, temperature=0, max_tokens=64)
    r = client.chat.completions.create(messages=messages, tool_choice="required", extra_body=ON, **args)
    off = client.chat.completions.create(messages=messages, tool_choice="required", extra_body=OFF, **args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    assert "city" in json.loads(call.function.arguments)
    assert [(c.function.name, c.function.arguments) for c in off.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # a named function: that one is called
    named = client.chat.completions.create(
        messages=messages, tool_choice={"type": "function", "function": {"name": "get_time"}}, **args)
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    # streamed: the call arrives as a tool_calls delta, the stream ends with finish_reason tool_calls
    chunks = list(client.chat.completions.create(messages=messages, tool_choice="required", stream=True,
                                                 extra_body=ON, **args))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, call.function.name, call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the loop goes on: the call and its result go back, and the model answers with them in its prompt
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees C and sunny"}]
    r2 = client.chat.completions.create(messages=messages, tool_choice="auto", **args)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls
    # tool_choice none: the tools are not shown, and nothing is parsed
    plain = client.chat.completions.create(messages=messages[:1], tool_choice="none", **args)
    assert plain.choices[0].message.tool_calls is None and plain.usage.prompt_tokens < r.usage.prompt_tokens


def test_bad_tool_fields_are_400s(server):
    _, base = server
    with httpx.Client(base_url=base, timeout=60) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for extra, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                              "tool_choice"),
                             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
                             ({"tool_choice": "required"}, "tool_choice"),
                             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                              "tool_choice")]:
            r = http.post("/v1/chat/completions", json=body | extra)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)


def test_n_choices_streamed_and_not(client, server):
    msgs = [{"role": "user", "content": "Name a fruit and say why you like it."}]
    args = dict(model="m", messages=msgs, max_tokens=24, temperature=0.9, seed=5, extra_body=ON)

    def shared() -> int:
        return httpx.get(f"{server[1]}/v1/stats", timeout=30).json()["scheduler"]["shared_prompts"]

    before = shared()
    r = client.chat.completions.create(n=3, **args)
    assert shared() - before == 2  # two choices copied the first one's prompt cells
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # own seeds: own samples
    # choice i is what the request alone gives with seed 5 + i (exact mode; its prompt cells were copied)
    for i in (0, 2):
        solo = client.chat.completions.create(n=1, **(args | {"seed": 5 + i}))
        assert solo.choices[0].message.content == texts[i]
    assert r.usage.completion_tokens == sum(
        client.chat.completions.create(n=1, **(args | {"seed": 5 + i})).usage.completion_tokens for i in range(3))
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args))
    streamed = ["", "", ""]
    finished = set()
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert streamed == texts and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    comp = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0, n=2)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text  # greedy


def test_n_over_the_slots_is_a_400(server):
    _, base = server
    with httpx.Client(base_url=base, timeout=60) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for n in (5, 17, 0):  # the server has 4 slots; 16 is the most any server takes
            r = http.post("/v1/chat/completions", json=body | {"n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", (n, r.text)
