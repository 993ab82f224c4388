"""Admission: an EngineRequest (request.py) -> the engine's request, or a BadRequest that names what is wrong.

Runs on the caller's (asyncio) side, before the round thread sees anything,
so a bad request costs no round and its answer names the limit it broke.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specray.engine.config import ChainConfig
from specray.engine.request import GenerationRequest

from .errors import BadRequest
from .request import Constraint, EngineRequest

#: stop strings: OpenAI allows 4; the cap keeps the per-token stop matching cheap
MAX_STOPS, MAX_STOP_CHARS = 16, 512


@dataclass
class ServeRequest(GenerationRequest):
    """A GenerationRequest plus what the router did to it on the way in."""

    truncated_prompt_tokens: int = 0  # prompt tokens dropped (from the left) to fit the context
    t_arrival: float = field(default_factory=time.perf_counter)  # reached the replica (TTFT starts here)


def fit_prompt(n_prompt: int, max_tokens: int, n_ctx_seq: int, draft_room: int, truncate: bool) -> int:
    """Prompt tokens to drop from the left so prompt + max_tokens + a draft + 1 fit a sequence's context
    (the Scheduler's own check); BadRequest if they cannot, or if dropping is not allowed.

    >>> fit_prompt(100, 50, 512, 16, truncate=False)
    0
    >>> fit_prompt(500, 50, 512, 16, truncate=True)   # room for 512 - 50 - 16 - 1 = 445 prompt tokens
    55
    """
    room = n_ctx_seq - max_tokens - draft_room - 1
    if max_tokens >= n_ctx_seq or room < 1:
        raise BadRequest(
            f"max_tokens ({max_tokens}) does not fit the context of {n_ctx_seq} tokens per sequence "
            f"(with room for {draft_room} draft tokens)", param="max_tokens")
    if n_prompt <= room:
        return 0
    if truncate:
        return n_prompt - room
    raise BadRequest(
        f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {n_ctx_seq} "
        f"tokens per sequence; shorten the prompt or lower max_tokens", param="prompt",
        code="context_length_exceeded")


class Admission:
    """Builds ServeRequests for one replica: its vocabulary, its context size and its current chain."""

    def __init__(self, model, n_ctx_seq: int, chain_config: Callable[[], ChainConfig], truncate: bool,
                 slots: int | None = None, context_shift: bool = False, can_shift: bool = True) -> None:
        self.model = model  # tokenizes (vocabulary only when the target is an actor)
        self.n_ctx_seq = n_ctx_seq
        self.chain_config = chain_config  # the running chain's config (it changes with a live update)
        self.truncate = truncate  # ServeConfig.prompt_overflow == "truncate"
        self.slots = slots  # n > 1 asks for this many sequences at once at most
        self.context_shift = context_shift  # EngineConfig.context_shift: requests that do not say take it
        self.can_shift = can_shift  # the target's memory can shift positions (not recurrent or hybrid)
        self._grammars = None  # compiles requests' grammars (native.grammar.GrammarCompiler), made at first use

    def make_request(self, request: EngineRequest) -> ServeRequest:
        """The engine request for the ingress's EngineRequest; BadRequest (400) for anything wrong with it."""
        try:
            return self._make_request(request)
        except BadRequest:
            raise
        except UnicodeError:
            raise BadRequest("text must be valid Unicode (lone surrogate escapes are not)") from None
        except (ValueError, TypeError, OverflowError) as e:
            raise BadRequest(str(e)) from None

    def grammar(self, constraint: Constraint) -> str:
        """The GBNF of a request's constraint, compiled once against this vocabulary: a 400 naming the field if
        it does not."""
        from specray.native.grammar import (JSON_OBJECT_GBNF, GrammarCompiler, GrammarError, schema_to_gbnf,
                                            tool_call_gbnf)

        param = constraint.param or "grammar"
        kind, value = constraint.kind, constraint.value
        try:
            gbnf = (value if kind == "gbnf" else JSON_OBJECT_GBNF if kind == "json_object"
                    else schema_to_gbnf(value) if kind == "json_schema"
                    else tool_call_gbnf(value) if kind == "tool_call" else None)
            if gbnf is None:
                raise GrammarError(f"unknown constraint kind {kind!r}")
            if self._grammars is None:
                self._grammars = GrammarCompiler.of(self.model)
            self._grammars.check(gbnf)
        except GrammarError as e:
            raise BadRequest(str(e), param=param, code="invalid_grammar") from None
        return gbnf

    def prompt_tokens(self, request: EngineRequest) -> np.ndarray:
        if request.messages is not None:
            msgs = request.messages
            if not msgs:
                raise BadRequest("messages must not be empty", param="messages")
            return self.model.chat_tokens(msgs, tools=request.tools)
        if request.prompt_tokens is not None:
            return self._token_ids(request.prompt_tokens)
        prompt = request.prompt
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def _token_ids(self, ids) -> np.ndarray:
        bad = f"prompt token ids must be in [0, {self.model.n_vocab})"
        try:
            toks = np.asarray(ids, dtype=np.int64)
        except (OverflowError, ValueError, TypeError):
            raise BadRequest(bad, param="prompt") from None
        if toks.ndim != 1:
            raise BadRequest("prompt token ids must be a flat list of integers", param="prompt")
        if toks.size == 0:
            raise BadRequest("prompt is empty", param="prompt")
        if toks.min() < 0 or toks.max() >= self.model.n_vocab:
            raise BadRequest(bad, param="prompt")
        return toks.astype(np.int32)

    def _make_request(self, request: EngineRequest) -> ServeRequest:
        kw: dict[str, Any] = {}
        if request.request_id:
            kw["request_id"] = request.request_id
        chain = request.chain
        stop = list(request.stop or [])
        if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise BadRequest(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters",
                               param="stop")
        max_tokens = int(request.max_tokens)
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        n_max = request.n_max
        prompt = self.prompt_tokens(request)
        c = self.chain_config()
        speculates = bool(c.speculators) if chain is None else bool(chain)
        draft_room = min(c.n_max, c.n_max if n_max is None else n_max) if speculates else 0
        sampling = request.sampling
        if request.constraint is not None:
            sampling = sampling.model_copy(update={"grammar": self.grammar(request.constraint)})
        if sampling.logit_bias and max(sampling.logit_bias) >= self.model.n_vocab:
            raise BadRequest(f"logit_bias token {max(sampling.logit_bias)} is outside the vocabulary "
                               f"[0, {self.model.n_vocab})", param="logit_bias")
        shift = request.context_shift
        shift = self.context_shift if shift is None else bool(shift)
        if shift and not self.can_shift:
            raise BadRequest("context_shift is not possible on this model: its memory (recurrent or hybrid) "
                               "cannot shift positions", param="context_shift")
        # a shifting sequence goes past its context: only its prompt (and one token) must fit
        dropped = fit_prompt(len(prompt), 1 if shift else max_tokens, self.n_ctx_seq, draft_room, self.truncate)
        if request.share_prompt is not None and self.slots is not None:
            n = int(request.share_prompt_n) if request.share_prompt_n else 1
            if n > self.slots:
                raise BadRequest(f"n ({n}) is more than this server's {self.slots} slots", param="n")
        return ServeRequest(
            share_prompt=request.share_prompt,
            prompt_tokens=prompt[dropped:].copy() if dropped else prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            chain=None if chain is None else tuple(chain),
            n_max=n_max,
            tree=request.tree,
            ignore_eos=bool(request.ignore_eos),
            cache_prompt=bool(request.cache_prompt),
            tune_class=request.tune_class or "default",
            context_shift=request.context_shift,
            n_keep=request.n_keep,
            n_discard=request.n_discard,
            truncated_prompt_tokens=dropped,
            **kw,
        )
