"""Chat formatting with Jinja templates (no model needed)."""

from __future__ import annotations

import doctest

import pytest

from specray.native import chat_template
from specray.native.chat_template import ChatTemplateError, is_jinja, render_chat


def test_doctests():
    failed, attempted = doctest.testmod(chat_template)
    assert attempted >= 3 and failed == 0


def test_blocks_on_their_own_lines_leave_no_blank_lines():
    # templates are written for trim_blocks/lstrip_blocks, as HF transformers renders them
    t = "{% for m in messages %}\n  {% if m['role'] == 'user' %}\nU:{{ m['content'] }}\n  {% endif %}\n{% endfor %}"
    assert render_chat(t, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "U:a\nU:b\n"


def test_special_tokens_and_generation_prompt_are_passed_through():
    t = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{% if add_generation_prompt %}>{% endif %}"
    assert render_chat(t, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>") == "<s>x</s>>"
    assert render_chat(t, [{"role": "user", "content": "x"}], add_generation_prompt=False) == "x"


def test_names_are_not_jinja():
    assert not is_jinja("chatml") and not is_jinja("gemma")
    assert is_jinja("{{ messages }}") and is_jinja("{% if x %}{% endif %}")


def test_a_render_failure_is_a_value_error_naming_the_template():
    with pytest.raises(ChatTemplateError, match="chat template failed") as e:
        render_chat("{{ messages[5]['content'] }}", [{"role": "user", "content": "x"}])
    assert isinstance(e.value, ValueError)
