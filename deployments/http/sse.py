"""The SSE body of a streamed completion: OpenAI's delta chunks from the replica's stream items
(deployments/replica/stream_items.py)."""

from __future__ import annotations

import json
from time import perf_counter

from specray.deployments.http.openai_schema import (
    DeltaTemplate,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    echo_text,
    now,
)
from specray.deployments.http.errors import openai_error
from specray.deployments.http.socket_sink import SocketSink
from specray.deployments.http.timing import StreamClock
from specray.deployments.http.tool_calls import ToolCallStream
from specray.deployments.replica.errors import ClientGone
from specray.deployments.replica.stream_items import StreamDelta, StreamEnd, StreamError


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_body(gen, rid: str, model: str, records, chat: bool, include_usage: bool, arm: str, clock: StreamClock,
                   timing: bool = False, logprobs_on: bool = False, tools: ToolCallStream | None = None,
                   direct: SocketSink | None = None):
    """The SSE body, from the replica's items after its StreamStart. Deltas (one per round per stream at most:
    the replica merges what queued up) are written from a per-stream template: no dict or json.dumps per
    chunk (openai_schema.DeltaTemplate). With `timing` the final chunk carries the per-stage breakdown under
    `specray_timing` (timing.py). `tools`: the request offered tools; its text goes through the splitter,
    <tool_call> blocks going out as `tool_calls` deltas (logprobs are not streamed then). `direct`: the
    stream's SocketSink (the round thread writes the plain deltas with the same template; this body yields
    the rest); closed when the body ends, so no write follows the last chunk. An error (the stream's
    StreamError or one raised) is an error event (errors.openai_error), then `data: [DONE]`."""
    created = now()
    finished = False
    tag = {"arm": arm}
    delta = DeltaTemplate(rid, model, created, chat, tag)
    if direct is not None:
        direct.template = delta
    offset = 0  # completions logprobs' text_offset of the next token
    n_calls: list = []  # tool calls streamed so far (their delta index)
    try:
        if chat:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}) | tag)
        async for item in gen:
            t_got = perf_counter()
            if type(item) is StreamDelta:
                if tools is not None:
                    for line in _tool_deltas(tools.feed(item.text), rid, model, created, tag, n_calls):
                        yield line
                elif item.logprobs is not None or item.prompt_logprobs is not None:
                    # the slow path: the delta carries its tokens' logprobs (or, echo, the prompt's)
                    lps = item.logprobs or []
                    if chat:
                        line = sse(chat_chunk(rid, model, created, {"content": item.text},
                                               logprobs=chat_logprobs(lps)) | tag)
                    else:
                        plps = item.prompt_logprobs or []
                        entries = plps + lps
                        logprobs = completion_logprobs(entries, offset) if logprobs_on else None
                        line = sse(completion_chunk(rid, model, created, echo_text(plps) + item.text,
                                                     logprobs=logprobs) | tag)
                        offset += sum(len(e["token"]) for e in entries)
                    yield line
                else:
                    line = delta.sse(item.text)
                    clock.sse_s += perf_counter() - t_got
                    clock.sse_n += 1
                    yield line
            elif type(item) is StreamEnd:
                clock.end_chunk()
                records.add(item.summary())
                finish = item.finish_reason
                if tools is not None:
                    for line in _tool_deltas(tools.close(), rid, model, created, tag, n_calls):
                        yield line
                    finish = "tool_calls" if n_calls and finish == "stop" else finish
                last = (chat_chunk(rid, model, created, {}, finish) if chat
                        else completion_chunk(rid, model, created, "", item.finish_reason)) | tag
                if include_usage:
                    yield sse(last)
                    last = {"id": rid, "object": last["object"], "created": created, "model": model,
                            "choices": [], "usage": item.usage, "speculative": item.speculative} | tag
                else:
                    last["usage"] = item.usage
                    last["speculative"] = item.speculative
                stages = clock.stages(item.timing or {})
                records.add_stages(stages)
                if timing:
                    last["specray_timing"] = stages
                yield sse(last)
                finished = True
            elif type(item) is StreamError:
                status, body = openai_error(item.error)
                if not isinstance(item.error, ClientGone):  # the socket sink found the client gone: no error
                    records.add_error(status)
                yield sse(body)
                finished = True
                break
    except Exception as e:
        status, body = openai_error(e)
        records.add_error(status)
        yield sse(body)
        finished = True
    finally:
        if direct is not None:
            direct.close()
            records.add_direct(direct.summary())
        if not finished:
            gen.cancel()  # the client went away: the replica frees the slot
    yield sse("[DONE]")


def _tool_deltas(parts: list, rid: str, model: str, created: int, tag: dict, n_calls: list):
    """SSE lines of a ToolCallStream's output: text as content deltas, each call as one `tool_calls` delta
    (its whole arguments at once: the call is parsed when its block closes); `n_calls` counts the calls."""
    for p in parts:
        if isinstance(p, str):
            if p:
                yield sse(chat_chunk(rid, model, created, {"content": p}) | tag)
        else:
            yield sse(chat_chunk(rid, model, created, {"tool_calls": [{"index": len(n_calls)} | p]}) | tag)
            n_calls.append(p)
