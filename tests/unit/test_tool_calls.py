"""Tool-call parsing (deployments/http/tool_calls.py): streamed in any split, the same as parsed whole."""

import json

from specray.deployments.http.tool_calls import ToolCallStream, parse_tool_calls, tool_call_schema

TEXT = ('I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> done <tool_c')


def _split(text, sizes):
    s, out, i, k = ToolCallStream(), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out += s.feed(text[i : i + n])
        i, k = i + n, k + 1
    out += s.close()
    text_out = "".join(p for p in out if isinstance(p, str))
    calls = [(p["function"]["name"], json.loads(p["function"]["arguments"])) for p in out if isinstance(p, dict)]
    return text_out, calls


def test_any_split_gives_the_same_calls_and_text():
    whole = _split(TEXT, [len(TEXT)])
    assert whole == ("I will look. done <tool_c", [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})])
    for sizes in ([1], [2, 3], [7], [5, 1, 11]):
        assert _split(TEXT, sizes) == whole


def test_a_block_that_is_no_call_stays_text_and_ids_differ():
    content, calls = parse_tool_calls("<tool_call>not json</tool_call>")
    assert calls == [] and content == "<tool_call>not json</tool_call>"
    content, calls = parse_tool_calls(TEXT)
    assert content == "I will look. done <tool_c" and len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')  # cut by max_tokens
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_a_schema_per_choice():
    funcs = [{"name": "a", "parameters": {"type": "object"}}, {"name": "b", "parameters": {"type": "object"}}]
    assert [s["properties"]["name"]["const"] for s in tool_call_schema(funcs, "*")["anyOf"]] == ["a", "b"]
    assert tool_call_schema(funcs, "b")["properties"]["name"] == {"const": "b"}
