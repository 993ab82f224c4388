"""Context shift in both deployment modes, through the official openai client: in the distributed mode the
shift travels to the target actor with the sequence's rows (StepItem.shift). Greedy text with speculation on
equals text with it off (exact mode, 512 cells per slot, 560 tokens: one shift)."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.model]

MAX_TOKENS = 560


@pytest.fixture(scope="module")
def client(server):
    _, base = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)


def test_shifted_generation_in_each_mode(client, server):
    def complete(extra):
        return client.completions.create(model="m", prompt="Count from one to one thousand in words:",
                                         max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "context_shift": True} | extra)

    on, off = complete({}), complete({"speculative": {"enabled": False}})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == MAX_TOKENS
    assert on.choices[0].text == off.choices[0].text, server[0]
    with pytest.raises(openai.BadRequestError):  # without it the request does not fit, as before
        client.completions.create(model="m", prompt="Count:", max_tokens=MAX_TOKENS)
