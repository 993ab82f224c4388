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


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt text for `messages` under Jinja `template`."""
    msgs = [{**m, "role": str(m.get("role", "")), "content": message_text(m.get("content"))} for m in messages]
    try:
        return compile_template(template).render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed on these messages: {e}") from None
