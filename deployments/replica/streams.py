"""Per-request bookkeeping of the round thread: a request's `Stream` (its sink and sequence), the ops posted to
the round thread, and the items a finished sequence ends with (`end_info`; logprob entries for deltas).
Delivery goes through each stream's sink (sinks.py).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from specray.engine.request import GenerationRequest, Sequence

from .metrics import timing_of
from .sinks import Sink
from .stream_items import StreamEnd


@dataclass
class Stream:
    """One request's way back to its caller."""

    loop: asyncio.AbstractEventLoop
    sink: Sink  # where the round thread delivers its items (sinks.py)
    seq: Sequence | None = None
    abandoned: bool = False  # the caller went away before the submission was answered


@dataclass
class Op:
    """Work posted to the round thread, applied at the top of the next round."""

    kind: str  # submit | cancel | call
    req: GenerationRequest | None = None
    stream: Stream | None = None
    future: asyncio.Future | None = None
    seq: Sequence | None = None
    fn: Any = None
    done: threading.Event | None = None
    result: list = field(default_factory=list)
    round_posted: int = 0  # scheduler round count when posted (cancel latency in rounds)


def end_info(seq: Sequence) -> StreamEnd:
    n_prompt = len(seq.req.prompt_tokens)
    n_gen = len(seq.generated)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
             # as OpenAI reports it: prompt tokens whose KV was reused (the prompt cache), not prefilled
             "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}
    truncated = getattr(seq.req, "truncated_prompt_tokens", 0)
    if truncated:
        usage["truncated_prompt_tokens"] = truncated
    return StreamEnd(seq.finish_reason, usage, seq.spec_summary() | {"rounds": seq.rounds}, timing_of(seq))


def logprob_entries(lps, tokens: list[int], piece) -> list[dict]:
    """JSON-ready entries of emitted tokens' logprobs (engine/logprobs.TokenLogprobs): per token its id, text,
    UTF-8 bytes, logprob and its top alternatives as [text, bytes, logprob]; `piece(token)` -> bytes. The
    ingress shapes them as OpenAI's chat or completions logprobs (openai_schema.py)."""
    def text_bytes(t: int) -> tuple[str, list[int]]:
        b = piece(int(t))
        return b.decode("utf-8", "replace"), list(b)

    out = []
    for i, t in enumerate(tokens):
        s, b = text_bytes(t)
        top = [[*text_bytes(a), float(lp)] for a, lp in zip(lps.top_ids[i], lps.top_logprobs[i])]
        out.append({"id": int(t), "token": s, "bytes": b, "logprob": float(lps.logprob[i]), "top": top})
    return out


def prompt_logprob_entries(chunks: list, prompt, piece) -> list[dict]:
    """Echo: the prompt tokens' entries (as logprob_entries), the first one without a logprob (nothing
    predicts it); `chunks`: the prompt's TokenLogprobs by prefill chunk, for tokens 1..."""
    from specray.engine.logprobs import concat

    first = piece(int(prompt[0]))
    head = {"id": int(prompt[0]), "token": first.decode("utf-8", "replace"), "bytes": list(first), "logprob": None,
            "top": None}
    lps = concat(chunks)
    return [head] + logprob_entries(lps, [int(t) for t in prompt[1 : 1 + len(lps)]], piece)


def resolve(fut: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
