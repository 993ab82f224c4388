"""EngineRequest: what the ingress asks an engine replica to generate, typed.

The HTTP layer builds one from an OpenAI request body in one place (openai_schema `to_engine`); the
replica's Admission turns it into the engine's GenerationRequest (tokenized, fitted to the context). It
crosses the Serve handle between the ingress and the replica as a pickled dataclass.

>>> r = EngineRequest(prompt="The capital of France is", max_tokens=4, chain=("suffix",))
>>> r.max_tokens, r.chain, r.sampling.temperature, r.constraint
(4, ('suffix',), 0.0, None)
>>> replace(r, request_id="cmpl-1").request_id
'cmpl-1'
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from specray.engine.sampling import SamplingParams

__all__ = ["Constraint", "EngineRequest", "replace", "DEFAULT_MAX_TOKENS"]

#: max_tokens of a request that names none (OpenAI's default for completions is 16; chat has none)
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Constraint:
    """What the output must follow; the replica compiles it against its vocabulary (Admission.grammar).

    kind: 'gbnf' (value: the grammar), 'json_object' (value: None), 'json_schema' (value: the schema) or
    'tool_call' (value: the call's schema); param: the request field it came from (a 400 names it).
    """

    kind: str
    value: Any
    param: str


@dataclass(frozen=True)
class EngineRequest:
    """One generation as the replica takes it: exactly one of `prompt`, `prompt_tokens` and `messages`.

    `sampling` defaults to the engine's (greedy); the ingress always sets it (OpenAI's temperature default is
    1). `chain`: None takes the
    replica's chain, () decodes plainly. `n` > 1 is fanned out by the ingress (choices.py) into n requests
    sharing `share_prompt` (the first's id), `share_prompt_n` of them, each with n = 1.
    """

    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    messages: list[dict] | None = None  # {"role", "content", ["tool_calls"], ["tool_call_id"]}: the chat template's
    tools: list[dict] | None = None  # function tools shown to the model by the chat template
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    chain: tuple[str, ...] | None = None
    n_max: int | None = None
    tree: bool = True  # False: linear drafts only
    tune_class: str | None = None  # None: the class "default"
    ignore_eos: bool = False
    cache_prompt: bool = True
    context_shift: bool | None = None  # None: the replica's setting
    n_keep: int | None = None
    n_discard: int | None = None
    constraint: Constraint | None = None
    n: int = 1
    request_id: str | None = None  # None: the engine numbers it
    share_prompt: str | None = None
    share_prompt_n: int | None = None
