"""What flows from the round thread to each request's asyncio stream, and how it gets there.

The round thread never touches an event loop directly: it collects
(queue, item) pairs per loop during a round and hands each loop its batch with
one `call_soon_threadsafe` (one wake-up per event loop per round).

Items: {"type": "delta", "text", "t"} ("t": perf_counter when the round
produced it; "logprobs": logprob_entries of its tokens where the request asked
for them), then one of {"type": "end", ...} (end_info)
or {"type": "error", ...} (error_item). A stream with a DirectLink (direct.py)
gets only what the round thread did not write to its socket itself, each item
numbered ("n") by the link, and {"type": "raw", "data", "n"}: the rest of a
chunk the socket did not take whole, for the loop to write first.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from specray.engine.request import GenerationRequest, Sequence

from .direct import DirectLink
from .metrics import timing_of


@dataclass
class Stream:
    """One request's way back to its caller."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence | None = None
    abandoned: bool = False  # the caller went away before the submission was answered
    direct: DirectLink | None = None  # the round thread may write plain deltas to the socket (direct.py)


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


#: per event loop, the (queue, item) pairs a round produced for it
Outbox = dict[asyncio.AbstractEventLoop, list]


def end_info(seq: Sequence) -> dict:
    n_prompt = len(seq.req.prompt_tokens)
    n_gen = len(seq.generated)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
             # as OpenAI reports it: prompt tokens whose KV was reused (the prompt cache), not prefilled
             "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}
    truncated = getattr(seq.req, "truncated_prompt_tokens", 0)
    if truncated:
        usage["truncated_prompt_tokens"] = truncated
    return {
        "type": "end",
        "finish_reason": seq.finish_reason,
        "usage": usage,
        "speculative": seq.spec_summary() | {"rounds": seq.rounds},
        "timing": timing_of(seq),
    }


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


def error_item(status: int, message: str, code: str | None = None) -> dict:
    return {"type": "error", "status": status, "message": message, "param": None, "code": code}


def resolve(fut: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def flush(out: Outbox) -> None:
    """Hand every loop the items of this round (one wake-up each)."""
    for loop, items in out.items():
        if items:
            call_in_loop(loop, deliver, items)


async def next_chunk(queue: asyncio.Queue) -> tuple[str, dict | None]:
    """Wait for the next item, then take whatever else is queued already.

    Returns (text, terminal): the text of every delta taken, and the end/error
    item if one was reached (a stream has nothing after it).
    """
    text, term, _ = await next_chunk_stamped(queue)
    return text, term


def _collect(item: dict, into: dict[str, list] | None) -> None:
    if into is not None:
        for key, entries in into.items():
            entries.extend(item.get(key, ()))


async def next_chunk_stamped(queue: asyncio.Queue, logprobs: dict[str, list] | None = None,
                             numbered: list | None = None) -> tuple[str, dict | None, float | None]:
    """next_chunk, plus when the round thread produced the oldest delta taken (perf_counter; None if
    no delta was taken): the replica's emit stage is "now" minus that, once per chunk it yields. The deltas'
    entries under each key of `logprobs` ("logprobs", "prompt_logprobs") are added to its lists; `numbered[0]`
    becomes the number ("n") of the last delta taken, where items carry one (a DirectLink's stream). Any item
    but a delta ends the chunk: it is returned as the terminal one (a "raw" item is not the stream's end)."""
    item = await queue.get()
    if item["type"] != "delta":
        return "", item, None
    t_made = item.get("t")
    if queue.empty():  # the common case: one round's delta, nothing to merge
        _collect(item, logprobs)
        if numbered is not None:
            numbered[0] = item.get("n")
        return item["text"], None, t_made
    texts: list[str] = []
    while True:
        if item["type"] != "delta":
            return "".join(texts), item, t_made
        texts.append(item["text"])
        _collect(item, logprobs)
        if numbered is not None:
            numbered[0] = item.get("n")
        if queue.empty():
            return "".join(texts), None, t_made
        item = queue.get_nowait()
