"""Every field of the OpenAI request models reaches the engine request, is handled by the ingress, or is refused.

Walks the pydantic models' fields: a field added to a model without a line here fails the walk, and each
listed field, set to a value that is not its default, must arrive in the EngineRequest (openai_schema's
`to_engine`, the one place the HTTP request becomes the engine's).
"""

from __future__ import annotations

import pickle

import pytest

from specray.deployments.http.openai_schema import (
    HTTP_FIELDS,
    MESSAGE_IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    SpeculativeOptions,
    StreamOptions,
)
from specray.deployments.replica.errors import BadRequest
from specray.deployments.replica.request import Constraint, EngineRequest

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
GBNF = 'root ::= "a"'

#: field -> (a value that is not the default, the check that it arrived); both bodies share these
COMMON = {
    "max_tokens": (7, lambda r: r.max_tokens == 7),
    "temperature": (0.5, lambda r: r.sampling.temperature == 0.5),
    "top_p": (0.5, lambda r: r.sampling.top_p == 0.5),
    "top_k": (5, lambda r: r.sampling.top_k == 5),
    "min_p": (0.1, lambda r: r.sampling.min_p == 0.1),
    "repeat_penalty": (1.3, lambda r: r.sampling.repeat_penalty == 1.3),
    "stop": (["x", "y"], lambda r: r.stop == ("x", "y")),
    "seed": (42, lambda r: r.sampling.seed == 42),
    "n": (3, lambda r: r.n == 3),
    "speculative": ({"chain": "suffix", "n_max": 3, "tune_class": "c1", "tree": False},
                    lambda r: (r.chain, r.n_max, r.tune_class, r.tree) == (("suffix",), 3, "c1", False)),
    "ignore_eos": (True, lambda r: r.ignore_eos is True),
    "cache_prompt": (False, lambda r: r.cache_prompt is False),
    "context_shift": (True, lambda r: r.context_shift is True),
    "n_keep": (5, lambda r: r.n_keep == 5),
    "n_discard": (3, lambda r: r.n_discard == 3),
    "presence_penalty": (0.5, lambda r: r.sampling.presence_penalty == 0.5),
    "frequency_penalty": (0.7, lambda r: r.sampling.frequency_penalty == 0.7),
    "logit_bias": ({"5": 2.0}, lambda r: r.sampling.logit_bias == {5: 2.0}),
    "grammar": (GBNF, lambda r: r.constraint == Constraint("gbnf", GBNF, "grammar")),
    "json_schema": ({"type": "object"},
                    lambda r: r.constraint == Constraint("json_schema", {"type": "object"}, "json_schema")),
    "response_format": ({"type": "json_object"},
                        lambda r: r.constraint == Constraint("json_object", None, "response_format")),
}
#: constraints exclude each other (a 400): the request with every field set carries only `grammar`
EXCLUSIVE = {"json_schema", "response_format"}

COMPLETION = COMMON | {
    "prompt": ("hello", lambda r: r.prompt == "hello" and r.messages is None),
    "echo": (True, lambda r: r.sampling.prompt_logprobs is True),
    "logprobs": (3, lambda r: r.sampling.logprobs == 3),
}
CHAT = COMMON | {
    "messages": ([{"role": "user", "content": "hi"}], lambda r: r.messages == [{"role": "user", "content": "hi"}]),
    "max_completion_tokens": (9, lambda r: r.max_tokens == 9),
    "tools": (TOOLS, lambda r: [t["name"] for t in r.tools or ()] == ["f"]),
    "tool_choice": ({"type": "function", "function": {"name": "f"}},
                    lambda r: r.constraint is not None and (r.constraint.kind, r.constraint.param)
                    == ("tool_call", "tool_choice")),
    "logprobs": (True, lambda r: r.sampling.logprobs is not None),  # 0 alternatives alone, top_logprobs with it
    "top_logprobs": (4, lambda r: r.sampling.logprobs == 4),
}
#: what a field needs beside it (and the body's required fields)
NEEDS = {"tool_choice": {"tools": TOOLS}, "top_logprobs": {"logprobs": True}}
REQUIRED = {CompletionRequest: {"prompt": "p"}, ChatCompletionRequest: {"messages": [{"role": "user", "content": "p"}]}}
#: the values that go with EXCLUSIVE's removal in the all-fields request (tool_choice forces a grammar of its own)
ALL_BUT = {ChatCompletionRequest: {"tool_choice": "auto"}}

SPECULATIVE = {
    "enabled": (False, lambda r: r.chain == ()),
    "chain": (["suffix", "ngram_mod"], lambda r: r.chain == ("suffix", "ngram_mod")),
    "n_max": (3, lambda r: r.n_max == 3),
    "tune_class": ("c1", lambda r: r.tune_class == "c1"),
    "tree": (False, lambda r: r.tree is False),
}
MESSAGE = {  # a chat message's fields, as the chat template gets them
    "role": ("developer", lambda m: m["role"] == "system"),
    "content": ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], lambda m: m["content"] == "ab"),
    "tool_calls": ([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                   lambda m: m["tool_calls"][0]["id"] == "c"),
    "tool_call_id": ("c", lambda m: m["tool_call_id"] == "c"),
}
MODELS = [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)]


@pytest.mark.parametrize("model, mapped", MODELS, ids=lambda m: getattr(m, "__name__", ""))
def test_every_field_is_mapped_handled_or_refused(model, mapped):
    fields = set(model.model_fields)
    handled = fields & HTTP_FIELDS
    refused = fields & REFUSED_FIELDS
    assert not set(mapped) & (HTTP_FIELDS | REFUSED_FIELDS), "a field is listed twice"
    assert fields == set(mapped) | handled | refused, (
        f"not accounted for: {sorted(fields - set(mapped) - handled - refused)}; listed but gone: "
        f"{sorted(set(mapped) - fields)}")
    assert set(SpeculativeOptions.model_fields) == set(SPECULATIVE)
    assert set(ChatMessage.model_fields) == set(MESSAGE) | MESSAGE_IGNORED_FIELDS
    assert set(ContentPart.model_fields) == {"type", "text"}  # the text of "text" parts (others: a 400)
    assert set(StreamOptions.model_fields) == {"include_usage"} and "stream_options" in HTTP_FIELDS


@pytest.mark.parametrize("model, mapped", MODELS, ids=lambda m: getattr(m, "__name__", ""))
def test_each_field_arrives_alone(model, mapped):
    plain = model(**REQUIRED[model]).to_engine()
    for name, (value, arrived) in mapped.items():
        r = model(**(REQUIRED[model] | NEEDS.get(name, {}) | {name: value})).to_engine()
        assert arrived(r), f"{model.__name__}.{name} = {value!r} did not reach the engine request: {r}"
        assert not arrived(plain), f"{name}: its check holds without it (a weak check)"


@pytest.mark.parametrize("model, mapped", MODELS, ids=lambda m: getattr(m, "__name__", ""))
def test_every_field_at_once_arrives(model, mapped):
    body = {name: value for name, (value, _) in mapped.items() if name not in EXCLUSIVE} | ALL_BUT.get(model, {})
    r = model(**body).to_engine()
    for name, (value, arrived) in mapped.items():
        if name in EXCLUSIVE or name in ALL_BUT.get(model, {}) or (model is ChatCompletionRequest
                                                                   and name == "max_tokens"):
            continue  # max_completion_tokens wins over max_tokens (each arrives alone above)
        assert arrived(r), f"{model.__name__}.{name} lost when every field is set: {r}"
    # the ingress's own fields change nothing the engine sees
    http = {"model": "any", "user": "u1", "stream": True, "stream_options": {"include_usage": True},
            "parallel_tool_calls": False}
    assert model(**body, **{k: v for k, v in http.items() if k in model.model_fields}).to_engine() == r
    assert pickle.loads(pickle.dumps(r)) == r  # what crosses the Serve handle to the replica


def test_speculative_and_message_fields_arrive():
    for name, (value, arrived) in SPECULATIVE.items():
        r = CompletionRequest(prompt="p", speculative={name: value}).to_engine()
        assert arrived(r), f"speculative.{name} = {value!r} did not arrive: {r}"
    for name, (value, arrived) in MESSAGE.items():
        msg = {"role": "assistant", "content": "x"} | {name: value}
        [m] = ChatCompletionRequest(messages=[msg]).to_engine().messages
        assert arrived(m), f"messages[].{name} = {value!r} did not arrive: {m}"
    assert CompletionRequest(prompt="p", repetition_penalty=1.2).to_engine().sampling.repeat_penalty == 1.2
    assert CompletionRequest(prompt=[1, 2, 3]).to_engine().prompt_tokens == [1, 2, 3]


@pytest.mark.parametrize("name, value", [("best_of", 2), ("suffix", "tail")])
def test_refused_fields_are_a_400_naming_them(name, value):
    assert name in REFUSED_FIELDS
    with pytest.raises(BadRequest) as e:
        CompletionRequest(prompt="p", **{name: value}).to_engine()
    assert (e.value.status, e.value.param) == (400, name)


def test_engine_request_defaults_are_the_engines():
    r = EngineRequest(prompt="p")
    assert (r.max_tokens, r.chain, r.tune_class, r.n, r.request_id, r.constraint) == (256, None, None, 1, None, None)
    assert r.sampling.temperature == 0.0  # the engine's greedy default; the ingress always sets OpenAI's 1.0
    assert CompletionRequest(prompt="p").to_engine().sampling.temperature == 1.0
