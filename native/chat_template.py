"""Chat formatting with a model's own Jinja template, rendered the way llama-server does.

llama.cpp's built-in formatter (`llama_chat_apply_template`) only recognises a
template's family and then formats in its own way. SmolLM2's template, for one,
starts every chat that has no system message with a default system prompt ("You
are a helpful AI assistant named SmolLM, ..."), and the built-in chatml formatter
leaves that out. llama-server renders the template itself (Jinja is on by default
since December 2025), and so do HF transformers. So do we: a model sees the
prompt it was trained on, and its answers match llama-server's. Template names
('chatml', 'gemma', ...) still go to llama.cpp's built-in formatter.

>>> t = ("{% if messages[0]['role'] != 'system' %}<sys>default</sys>{% endif %}"
...      "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
...      "{% if add_generation_prompt %}<assistant>{% endif %}")
>>> render_chat(t, [{"role": "user", "content": "hi"}])
'<sys>default</sys><user>hi</user><assistant>'
>>> render_chat(t, [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
...             add_generation_prompt=False)
'<system>be brief</system><user>hi</user>'
>>> render_chat("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
Traceback (most recent call last):
...
specray.native.chat_template.ChatTemplateError: chat template refused the messages: roles must alternate
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (its own `raise_exception`) or failed while rendering them."""


def is_jinja(template: str) -> bool:
    """True for Jinja template text; False for a built-in template name such as 'chatml'."""
    return "{%" in template or "{{" in template


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template refused the messages: {message}")


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per template text; jinja2.TemplateSyntaxError if it is not valid Jinja.

    trim_blocks/lstrip_blocks as in HF transformers and llama.cpp's Jinja engine:
    templates are written for them (block tags on their own lines leave no blank lines).
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def message_text(content) -> str:
    """A message's content as text: OpenAI content parts have their text parts joined (templates are
    written for plain text)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


#: the system prompt that shows tools to a model whose template does not (NousResearch's Hermes format, which
#: Qwen 2.5/3 templates also write); the model answers with <tool_call> blocks (deployments/http/tool_calls.py)
HERMES_TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def reads_tools(template: str) -> bool:
    """True if a Jinja template renders `tools` itself (Qwen, Hermes, Llama 3.1, ...)."""
    return is_jinja(template) and "tools" in template


def _arguments(call: dict) -> dict:
    """A call's arguments as a dict (OpenAI sends a JSON string; templates write them with tojson)."""
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": args}
    return args


def tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    r"""Messages for a template that does not read tools: the tools go into the system prompt (Hermes format),
    an assistant's tool calls become <tool_call> blocks of its text, a tool's result a user message in
    <tool_response> tags.

    >>> m = tool_messages([{"role": "user", "content": "hi"},
    ...                    {"role": "assistant", "content": None,
    ...                     "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]},
    ...                    {"role": "tool", "content": "42", "tool_call_id": "c1"}], None)
    >>> [(x["role"], x["content"]) for x in m]
    [('user', 'hi'), ('assistant', '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'), ('user', '<tool_response>\n42\n</tool_response>')]
    """
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [json.dumps({"name": c.get("function", {}).get("name"), "arguments": _arguments(c)})
                      for c in calls]
            text = message_text(m.get("content"))
            m["content"] = (text + "\n" if text else "") + "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{message_text(m.get('content'))}\n</tool_response>"}
        out.append(m)
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                                           for f in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": message_text(out[0].get("content")) + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages` under Jinja `template`; `tools` (OpenAI function dicts: name, description,
    parameters) go to a template that reads them, else into the messages (tool_messages)."""
    if reads_tools(template):
        msgs = [{**m, "role": str(m.get("role", "")), "content": message_text(m.get("content"))}
                | ({"tool_calls": [{"type": "function", "function": {"name": c.get("function", {}).get("name"),
                                                                     "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]} if m.get("tool_calls") else {})
                for m in messages]
        extra = {"tools": [{"type": "function", "function": f} for f in tools]} if tools else {}
    else:
        msgs = [{**m, "role": str(m.get("role", "")), "content": message_text(m.get("content"))}
                for m in tool_messages(messages, tools)]
        extra = {}
    try:
        return compile_template(template).render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed on these messages: {e}") from None
