"""Tools in chat prompts (native/chat_template.py): a template that reads `tools` gets them, with earlier calls'
arguments as dicts; one that does not gets the Hermes system prompt and <tool_call>/<tool_response> text."""

import json

from specray.native.chat_template import render_chat

TOOLS = [{"name": "get_weather", "description": "weather", "parameters": {"type": "object"}}]
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# a Qwen-like template: lists the tools, writes calls with their arguments as JSON
QWENISH = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
           "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
           "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} "
           "{{ c['function']['arguments'] | tojson }}{% endfor %}\n{% endfor %}")
HISTORY = [{"role": "user", "content": "Paris?"},
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]


def test_a_template_that_reads_tools_gets_them():
    text = render_chat(QWENISH, HISTORY, tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("TOOLS:get_weather;")
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments went in as a dict, not a JSON string
    assert "<|tool|>18 C" in text


def test_other_templates_get_the_hermes_prompt():
    text = render_chat(CHATML, HISTORY, tools=TOOLS)
    first = text.split("\n")[0]
    assert first.startswith("<|system|>You are a function calling AI model") and "<tools>" in text
    assert json.dumps({"type": "function", "function": TOOLS[0]}) in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|user|><tool_response>\n18 C\n</tool_response>" in text
    plain = render_chat(CHATML, HISTORY[:1])
    assert "tool" not in plain  # no tools, no history of calls: the prompt is untouched
