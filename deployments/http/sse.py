"""The SSE body of a streamed completion: OpenAI's delta chunks from the replica's stream of chunks."""

from __future__ import annotations

import json
import logging
from time import perf_counter

from specray.deployments.http.openai_schema import (
    DeltaTemplate,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    echo_text,
    OpenAIError,
    error_body,
    now,
)
from specray.deployments.http.engine_link import engine_lost
from specray.deployments.http.timing import StreamClock
from specray.deployments.http.tool_calls import ToolCallStream
from specray.deployments.replica.direct import DirectLink

log = logging.getLogger("specray.ingress")




def handle_error(e: Exception) -> OpenAIError:
    """Errors raised by a handle call (the replica itself answers bad requests with error chunks)."""
    name = type(e).__name__
    if name == "BackPressureError":
        return OpenAIError(f"server overloaded: {e}", 503, code="overloaded")
    if engine_lost(e):
        return OpenAIError(f"engine unavailable: {name}: {e}", 503, code="engine_unavailable")
    log.exception("engine call failed")
    return OpenAIError(f"internal error: {name}: {e}", 500)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_body(gen, rid: str, model: str, records, chat: bool, include_usage: bool, arm: str, clock: StreamClock,
                   timing: bool = False, logprobs_on: bool = False, tools: ToolCallStream | None = None,
                   direct: DirectLink | None = None):
    """The SSE body. Deltas (one per round per stream at most: the replica merges what queued up) are
    written from a per-stream template: no dict or json.dumps per chunk (openai_schema.DeltaTemplate).
    With `timing` the final chunk carries the per-stage breakdown under `specray_timing` (timing.py).
    `tools`: the request offered tools; its text goes through the splitter, <tool_call> blocks going out
    as `tool_calls` deltas (logprobs are not streamed then). `direct`: the stream's DirectLink (direct
    writes: the round thread writes the plain deltas with the same template; this body yields the rest);
    closed when the body ends, so no write follows the last chunk."""
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
        async for chunk in gen:
            t_got = perf_counter()
            t = chunk["type"]
            if t == "delta" and tools is not None:
                for line in _tool_deltas(tools.feed(chunk["text"]), rid, model, created, tag, n_calls):
                    yield line
            elif t == "delta" and ("logprobs" in chunk or "prompt_logprobs" in chunk):
                # the slow path: the chunk carries its tokens' logprobs (or, echo, the prompt's)
                lps = chunk.get("logprobs", [])
                if chat:
                    line = sse(chat_chunk(rid, model, created, {"content": chunk["text"]},
                                           logprobs=chat_logprobs(lps)) | tag)
                else:
                    plps = chunk.get("prompt_logprobs", [])
                    entries = plps + lps
                    logprobs = completion_logprobs(entries, offset) if logprobs_on else None
                    line = sse(completion_chunk(rid, model, created, echo_text(plps) + chunk["text"],
                                                 logprobs=logprobs) | tag)
                    offset += sum(len(e["token"]) for e in entries)
                yield line
            elif t == "delta":
                line = delta.sse(chunk["text"])
                clock.sse_s += perf_counter() - t_got
                clock.sse_n += 1
                yield line
            elif t == "end":
                clock.end_chunk()
                records.add(chunk)
                finish = chunk["finish_reason"]
                if tools is not None:
                    for line in _tool_deltas(tools.close(), rid, model, created, tag, n_calls):
                        yield line
                    finish = "tool_calls" if n_calls and finish == "stop" else finish
                last = (chat_chunk(rid, model, created, {}, finish) if chat
                        else completion_chunk(rid, model, created, "", chunk["finish_reason"])) | tag
                if include_usage:
                    yield sse(last)
                    last = {"id": rid, "object": last["object"], "created": created, "model": model,
                            "choices": [], "usage": chunk["usage"], "speculative": chunk["speculative"]} | tag
                else:
                    last["usage"] = chunk["usage"]
                    last["speculative"] = chunk["speculative"]
                stages = clock.stages(chunk.get("timing") or {})
                records.add_stages(stages)
                if timing:
                    last["specray_timing"] = stages
                yield sse(last)
                finished = True
            elif t == "error":
                if chunk.get("code") != "client_disconnected":  # a direct write found the client gone: no error
                    records.add_error(chunk["status"])
                yield sse(error_body(chunk["message"], chunk["status"], chunk.get("param"), chunk.get("code")))
                finished = True
                break
    except Exception as e:
        err = handle_error(e)
        records.add_error(err.status)
        yield sse(error_body(str(err), err.status, err.param, err.code))
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
