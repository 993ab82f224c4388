"""Structured outputs through the official `openai` client, both deployment modes: response_format json_schema
(`chat.completions.parse`), json_object, llama-server's `grammar` extension, streamed and not, with speculation
(the grammar speculator in the chain) and without; exact mode, so the text must not change. Bad grammars and
schemas are 400s naming the field."""

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
