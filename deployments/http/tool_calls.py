"""Tool calls in the Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

The model is shown the tools by its own chat template where the template reads `tools` (Qwen 2.5/3, Hermes,
...), else by a system prompt in the Hermes format (native/chat_template.py `tool_messages`). What it writes is
parsed back here into OpenAI's `tool_calls` (`parse_tool_calls`; `ToolCallStream` for streamed deltas), and
`tool_choice: "required"` or a named function becomes a JSON schema the output is held to by a grammar
(`tool_call_schema`; native/grammar.py `tool_call_gbnf` wraps it in the tags).
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"

__all__ = ["OPEN", "CLOSE", "ToolCallStream", "parse_tool_calls", "tool_call_schema", "check_tools"]


def check_tools(tools: list, tool_choice) -> tuple[list[dict], str | None]:
    """(the tools as function dicts, the name a call must use, "*" for any, or None for no constraint).
    ValueError naming what is wrong.

    >>> t = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    >>> check_tools(t, "auto")[1], check_tools(t, "required")[1], check_tools(t, {"type": "function", "function": {"name": "f"}})[1]
    (None, '*', 'f')
    """
    funcs = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError("each tool's function needs a name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"the parameters of tool {f['name']!r} must be a JSON schema object")
        funcs.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    names = [f["name"] for f in funcs]
    if tool_choice in (None, "auto", "none"):
        return funcs, None
    if tool_choice == "required":
        return funcs, "*"
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return funcs, name
    raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")


def tool_call_schema(funcs: list[dict], name: str) -> dict:
    """The JSON schema of one call: of function `name`, or of any of `funcs` for "*".

    >>> tool_call_schema([{"name": "f", "parameters": {"type": "object"}}], "f")["properties"]["name"]
    {'const': 'f'}
    """
    def one(f: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"]}

    chosen = [f for f in funcs if name in ("*", f["name"])]
    return one(chosen[0]) if len(chosen) == 1 else {"anyOf": [one(f) for f in chosen]}


def _call(body: str) -> dict | None:
    """One OpenAI tool call from a block's JSON, or None if it is not a call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the tool-call blocks, or None if only calls; the calls). A block whose JSON is not a
    call stays in the text.

    >>> content, calls = parse_tool_calls('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> content, calls[0]["function"]
    ('Sure.', {'name': 'f', 'arguments': '{"x": 1}'})
    """
    s = ToolCallStream()
    parts = s.feed(text) + s.close()
    content = "".join(p for p in parts if isinstance(p, str))
    calls = [p for p in parts if isinstance(p, dict)]
    return (content.strip() or None) if calls else content, calls


class ToolCallStream:
    """Splits streamed text into content (str) and tool calls (dict), holding back a tag's possible beginning.

    >>> s = ToolCallStream()
    >>> s.feed("Hi <tool"), s.feed('_call>{"name": "f", "arguments": {}}</tool_call>')[0]["function"]["name"]
    (['Hi '], 'f')
    """

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_tag(self.buf, OPEN)
                    if len(self.buf) > keep:
                        out.append(self.buf[: len(self.buf) - keep])
                        self.buf = self.buf[len(self.buf) - keep :]
                    return out
                if i:
                    out.append(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN) :], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE) :], False
                call = _call(body)
                out.append(call if call is not None else OPEN + body + CLOSE)

    def close(self) -> list:
        """The rest at the end of the text: an unclosed block is a call if its JSON is one, else text."""
        rest, self.buf = self.buf, ""
        if not self.inside:
            return [rest] if rest else []
        self.inside = False
        call = _call(rest)
        return [call if call is not None else OPEN + rest]


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
