"""OpenAI-compatible request bodies and response builders.

Unknown OpenAI fields are ignored (clients send many); fields specray cannot
honour with a non-default value (best_of, suffix) are refused with a 400
naming the field. `n > 1` gives n choices (choices.py). `tools` / `tool_choice` show the tools to the model
and parse its `<tool_call>` blocks back (tool_calls.py). `response_format` json_object / json_schema
and the `grammar` / `json_schema` extensions constrain the output with a
grammar (native/grammar.py; compiled in the replica, which knows the
vocabulary).
`logprobs` / `top_logprobs` (chat) and `logprobs: N` (completions) report
the raw distribution's log-probabilities (engine/logprobs.py), `echo` the
prompt's too; `presence_penalty`,
`frequency_penalty` and `logit_bias` shape sampling as llama.cpp's samplers
do (engine/sampling.py), with speculation on. Extensions:
`speculative` ({"chain", "n_max", "tree", "enabled", "tune_class"}), `top_k`, `min_p`,
`repeat_penalty` (alias `repetition_penalty`), `ignore_eos`, `cache_prompt` (the prompt cache;
reported as `usage.prompt_tokens_details.cached_tokens`), `context_shift` / `n_keep` / `n_discard`
(llama-server's context shift: a generation that reaches the context discards old tokens and goes on).
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring_ascii
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from specray.deployments.replica.errors import BadRequest
from specray.deployments.replica.request import DEFAULT_MAX_TOKENS, Constraint, EngineRequest
from specray.engine.config import parse_chain
from specray.engine.sampling import SamplingParams

from .tool_calls import check_tools, parse_tool_calls, tool_call_schema

#: the most choices (n) one request may ask for; the replica also refuses more than its slots
MAX_CHOICES = 16
#: request fields the ingress handles itself, never sent to the engine: `stream` / `stream_options` (the
#: response's shape), `user` (the A/B arm's session key), `model` (which model answers: deployments/models/directory.py)
#: and `parallel_tool_calls` (accepted; a reply's calls are parsed however many there are)
HTTP_FIELDS = frozenset({"model", "user", "stream", "stream_options", "parallel_tool_calls"})
#: request fields refused with a 400 naming them when set to anything but their default
REFUSED_FIELDS = frozenset({"best_of", "suffix"})
#: message fields accepted and not shown to the model (the chat templates take role and content only)
MESSAGE_IGNORED_FIELDS = frozenset({"name"})


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: plain decoding for this request")
    chain: str | list[str] | None = Field(None, description="speculators in priority order ('ngram_mod,suffix')")
    n_max: int | None = Field(None, ge=0, le=256, description="draft tokens per round at most (<= the server's)")
    tree: bool = Field(True, description="false: linear drafts only, no draft trees (runner-up branches verified "
                       "beside the draft)")
    tune_class: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="the request's class for online tuning of the speculators' parameters (a server with "
        "`chain.tune` keeps one choice per class; default: 'default')")

    def chain_names(self) -> list[str] | None:
        if not self.enabled:
            return []
        if self.chain is None:
            return None
        if isinstance(self.chain, str):
            names = parse_chain(self.chain)
        else:
            names = [str(n).strip() for n in self.chain if str(n).strip()]
            names = [] if names == ["none"] else names
        return list(dict.fromkeys(names))  # a speculator named twice runs once


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description=f"default {DEFAULT_MAX_TOKENS}")
    # allow_inf_nan=False: JSON's NaN / Infinity extensions are refused, never sampled with
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                  validation_alias=AliasChoices("repeat_penalty", "repetition_penalty"))
    stop: str | list[str] | None = None
    seed: int | None = Field(None, description="any integer; taken modulo 2**64 (the sampler's seeds are unsigned)")
    n: int | None = 1
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    ignore_eos: bool = False
    cache_prompt: bool = Field(
        True, description="reuse the KV of a prefix this server still holds from an earlier request (llama-server's "
        "name for it); false prefills the whole prompt. The output is the same either way")
    context_shift: bool | None = Field(
        None, description="when the generation reaches the context, discard old tokens and go on (llama-server's "
        "context shift); null: the server's setting (EngineConfig.context_shift). Without it a request must fit "
        "the context")
    n_keep: int | None = Field(None, ge=-1, description="context shift: tokens kept at the front (+ BOS); -1: the "
                               "whole prompt; null: the server's setting")
    n_discard: int | None = Field(None, ge=1, description="context shift: tokens discarded per shift; null: the "
                                  "server's setting (default: half of what lies past the kept ones)")
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string, OpenAI's shape) -> bias in [-100, 100] added to its logit")
    response_format: dict | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema'}; json_schema: {'json_schema': {'name': "
        "..., 'schema': {...}}} (OpenAI's shape) or {'schema': {...}} (llama-server's)")
    grammar: str | None = Field(None, description="a GBNF grammar the output follows (llama-server's extension)")
    json_schema: dict | None = Field(None, description="a JSON schema the output follows (llama-server's extension)")

    @field_validator("seed")
    @classmethod
    def _unsigned_seed(cls, v: int | None) -> int | None:
        return None if v is None else v % (1 << 64)

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise BadRequest(f"n must be in [1, {MAX_CHOICES}], got {self.n}", param="n")

    def logprob_count(self) -> int | None:
        """Alternatives to report per token, or None: no logprobs (the subclasses read their own fields)."""
        return None

    def bias(self) -> dict[int, float]:
        """logit_bias with integer keys; a 400 naming the field for a key that is no token id or a value
        outside [-100, 100] (a key past the vocabulary is refused where the vocabulary is known)."""
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                t = int(k)
            except ValueError:
                t = -1
            if t < 0:
                raise BadRequest(f"logit_bias keys must be token ids (integers >= 0), got {k!r}", param="logit_bias")
            if not -100.0 <= v <= 100.0:
                raise BadRequest(f"logit_bias values must be in [-100, 100], got {v} for token {k}",
                                  param="logit_bias")
            out[t] = float(v)
        return out

    def constraint(self) -> Constraint | None:
        """What the output must follow, for the replica to compile (kind 'gbnf' | 'json_object' | 'json_schema',
        its value, and the field it came from); None for free text. 400s name the field."""
        found = []
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise BadRequest("grammar must be a non-empty GBNF string", param="grammar")
            found.append(Constraint("gbnf", self.grammar, "grammar"))
        if self.json_schema is not None:
            found.append(Constraint("json_schema", self.json_schema, "json_schema"))
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                schema = rf.get("schema")  # llama-server also takes a schema here
                found.append(Constraint("json_schema", schema, "response_format") if schema else
                             Constraint("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else rf.get("schema")
                if not isinstance(schema, dict):
                    raise BadRequest("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                      param="response_format")
                found.append(Constraint("json_schema", schema, "response_format"))
            elif kind != "text":
                raise BadRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                  param="response_format")
        if len(found) > 1:
            raise BadRequest("give at most one of grammar, json_schema and a JSON response_format",
                              param=found[1].param)
        return found[0] if found else None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def to_engine(self) -> EngineRequest:
        """The engine request of this body: the one place an OpenAI request becomes what the replica takes.
        Every field either reaches the EngineRequest, is read by the ingress (HTTP_FIELDS) or is refused with
        a 400 naming it (REFUSED_FIELDS); tests/unit/test_engine_request.py walks them all.

        >>> r = CompletionRequest(prompt="hi", max_tokens=3, stop="\\n", speculative={"chain": "suffix"}).to_engine()
        >>> r.prompt, r.max_tokens, r.stop, r.chain, r.sampling.temperature
        ('hi', 3, ('\\n',), ('suffix',), 1.0)
        """
        self.refuse_unsupported()
        self.check_supported()
        spec = self.speculative
        try:
            chain = spec.chain_names() if spec else None
        except ValueError as e:
            raise BadRequest(str(e), param="speculative.chain") from None
        try:
            sampling = SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repeat_penalty=self.repeat_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self.bias(),
                logprobs=self.logprob_count(),
                prompt_logprobs=self.prompt_logprobs(),
                seed=self.seed,
            )
        except ValueError as e:  # pydantic's ValidationError; the fields above are checked already
            raise BadRequest(str(e)) from None
        constraint = self.constraint()
        inputs, constraint = self.inputs(constraint)
        max_tokens = self.max_tokens_asked()
        return EngineRequest(
            **inputs,
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            sampling=sampling,
            stop=tuple(self.stops()),
            chain=None if chain is None else tuple(chain),
            n_max=spec.n_max if spec else None,
            tree=spec.tree if spec else True,
            tune_class=spec.tune_class if spec else None,
            ignore_eos=self.ignore_eos,
            cache_prompt=self.cache_prompt,
            context_shift=self.context_shift,
            n_keep=self.n_keep,
            n_discard=self.n_discard,
            constraint=constraint,
            n=self.n or 1,
        )

    # ---- what the two bodies do differently (to_engine's steps) --------------------------------------
    def refuse_unsupported(self) -> None:
        """A 400 for a field this body cannot honour (checked before anything else)."""

    def prompt_logprobs(self) -> bool:
        """Whether the prompt's tokens come back (completions' echo)."""
        return False

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def inputs(self, constraint: Constraint | None) -> tuple[dict, Constraint | None]:
        """The EngineRequest fields that carry the input (prompt / prompt_tokens / messages, tools), and the
        constraint as the input leaves it (a forced tool call adds one)."""
        raise NotImplementedError


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of each token and this many "
                                 "most likely alternatives (OpenAI allows 5; llama-server more)")

    def logprob_count(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise BadRequest("best_of is not supported", param="best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")

    def prompt_logprobs(self) -> bool:
        # echo: the prompt comes back in front of the text, as its tokens (with their logprobs where asked)
        return self.echo

    def inputs(self, constraint: Constraint | None) -> tuple[dict, Constraint | None]:
        p = self.prompt
        if isinstance(p, list) and not p:
            raise BadRequest("prompt is empty", param="prompt")
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            d = {"prompt_tokens": list(p)}
        elif isinstance(p, list):
            if len(p) != 1:
                raise BadRequest("send exactly one prompt per request (a list of one string)", param="prompt")
            d = {"prompt": p[0]}
        else:
            d = {"prompt": p}
        if not d.get("prompt") and not d.get("prompt_tokens"):
            raise BadRequest("prompt is empty", param="prompt")
        return d, constraint


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (sent back in a tool-call loop)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_engine(self) -> dict:
        m = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text":
                raise BadRequest(f"content parts of type {p.type!r} are not supported (text only)",
                                  param="messages")
            parts.append(p.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def inputs(self, constraint: Constraint | None) -> tuple[dict, Constraint | None]:
        d: dict = {"messages": [m.to_engine() for m in self.messages]}
        if self.tools and self.tool_choice != "none":
            try:
                funcs, forced = check_tools(self.tools, self.tool_choice)
            except ValueError as e:
                raise BadRequest(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
            d["tools"] = funcs  # shown to the model (chat template), and its output parsed for calls
            if forced is not None:  # a call it must make: held to it by a grammar
                if constraint is not None:
                    raise BadRequest("tool_choice that forces a call cannot be combined with "
                                      f"{constraint.param}", param="tool_choice")
                constraint = Constraint("tool_call", tool_call_schema(funcs, forced), "tool_choice")
        elif self.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return d, constraint


# ---- responses -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def chat_logprobs(entries: list[dict]) -> dict:
    """OpenAI's chat `logprobs` of tokens (replica/streams.logprob_entries).

    >>> chat_logprobs([{"id": 5, "token": "hi", "bytes": [104, 105], "logprob": -0.1, "top": [["hi", [104, 105], -0.1]]}])
    {'content': [{'token': 'hi', 'logprob': -0.1, 'bytes': [104, 105], 'top_logprobs': [{'token': 'hi', 'logprob': -0.1, 'bytes': [104, 105]}]}], 'refusal': None}
    """
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in e["top"]]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's completions (legacy) `logprobs`; `offset`: the text offset of the first token.

    >>> completion_logprobs([{"id": 5, "token": "a", "bytes": [97], "logprob": -0.5, "top": [["a", [97], -0.5], ["b", [98], -1.5]]},
    ...                      {"id": 6, "token": "bc", "bytes": [98, 99], "logprob": -0.2, "top": []}])
    {'tokens': ['a', 'bc'], 'token_logprobs': [-0.5, -0.2], 'top_logprobs': [{'a': -0.5, 'b': -1.5}, {}], 'text_offset': [0, 1]}
    """
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    # an echoed prompt's first token has no logprob: null, as OpenAI and llama-server report it
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {t: lp for t, _, lp in e["top"]} for e in entries],
            "text_offset": offsets}


def echo_text(prompt_entries: list[dict]) -> str:
    """The echoed prompt: its tokens' text (what the logprobs' text offsets count)."""
    return "".join(e["token"] for e in prompt_entries)


def completion_response(rid: str, model: str, result: dict, logprobs: bool = False) -> dict:
    prompt = result.get("prompt_logprobs") or []  # echo
    return {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": 0, "text": echo_text(prompt) + result["text"], "finish_reason": result["finish_reason"],
                     "logprobs": completion_logprobs(prompt + (result.get("logprobs") or [])) if logprobs else None}],
        "usage": result["usage"], "speculative": result["speculative"],
    }


def chat_response(rid: str, model: str, result: dict, logprobs: bool = False, tools: bool = False) -> dict:
    """`tools`: the request offered tools, so <tool_call> blocks of the text become `message.tool_calls`."""
    message = {"role": "assistant", "content": result["text"]}
    finish = result["finish_reason"]
    if tools:
        content, calls = parse_tool_calls(result["text"])
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls" if finish == "stop" else finish
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": finish,
                     "logprobs": chat_logprobs(result.get("logprobs") or []) if logprobs else None}],
        "usage": result["usage"], "speculative": result["speculative"],
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


# ---- SSE chunks on the hot path --------------------------------------------------------------------
_TEXT_MARK = "@@specray-text@@"


class DeltaTemplate:
    r"""A stream's delta chunks as one precomputed SSE prefix and suffix around the JSON-escaped text.

    The chunk JSON (chat_chunk / completion_chunk, plus `extra` fields such as the arm) is the same for
    every delta of a stream but its text, so it is serialised once per stream; a delta then costs one
    C-level string escape and a concatenation, not a dict and a json.dumps (which, with non-default
    separators, also builds a new JSONEncoder per call). The bytes are exactly json.dumps' with
    separators (',', ':') and ensure_ascii:

    >>> t = DeltaTemplate("cmpl-1", "m", 7, chat=False, extra={"arm": "a"})
    >>> t.sse('say "hi"')
    'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"say \\"hi\\"","finish_reason":null,"logprobs":null}],"arm":"a"}\n\n'
    >>> c = DeltaTemplate("chatcmpl-1", "m", 7, chat=True, extra={"arm": "a"})
    >>> text = 'line\n\u00e9 \\ "q" \U0001F600'
    >>> c.sse(text) == "data: " + json.dumps(chat_chunk("chatcmpl-1", "m", 7, {"content": text}) | {"arm": "a"},
    ...                                      separators=(",", ":")) + "\n\n"
    True
    """

    def __init__(self, rid: str, model: str, created: int, chat: bool, extra: dict | None = None) -> None:
        obj = (chat_chunk(rid, model, created, {"content": _TEXT_MARK}) if chat
               else completion_chunk(rid, model, created, _TEXT_MARK)) | (extra or {})
        doc = json.dumps(obj, separators=(",", ":"))
        mark = json.dumps(_TEXT_MARK)
        assert doc.count(mark) == 1, "the text marker must appear once (a model id or arm equal to it?)"
        head, tail = doc.split(mark)
        self.prefix, self.suffix = "data: " + head, tail + "\n\n"

    def sse(self, text: str) -> str:
        return self.prefix + encode_basestring_ascii(text) + self.suffix
