"""`n > 1`: one request, n choices. The ingress sends n engine requests with one `share_prompt` key (the
engine prefills the prompt once and copies its KV cells to the others: engine/prompt_share.py), each with
its own seed (the request's seed + i, or fresh ones) and its own speculators, and merges their answers
into OpenAI's `choices[i]`, streamed (each delta tagged with its choice's index) or not.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse, StreamingResponse

from specray.deployments.http.errors import openai_error, serve_error
from specray.deployments.http.openai_schema import (
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    now,
)
from specray.deployments.http.sse import sse
from specray.deployments.replica.errors import ServeError
from specray.deployments.replica.request import EngineRequest, replace
from specray.deployments.replica.stream_items import StreamDelta, StreamEnd, StreamError
from specray.deployments.http.tool_calls import ToolCallStream

__all__ = ["fan_out", "merge_results", "generate_choices"]


def fan_out(req: EngineRequest, n: int) -> list[EngineRequest]:
    """The n engine requests of one: the same prompt under one share_prompt key, seeds seed + i.

    >>> from specray.engine.sampling import SamplingParams
    >>> rs = fan_out(EngineRequest(prompt="hi", request_id="c1", sampling=SamplingParams(seed=7), n=2), 2)
    >>> [(r.request_id, r.sampling.seed, r.share_prompt, r.share_prompt_n, r.n) for r in rs]
    [('c1-0', 7, 'c1', 2, 1), ('c1-1', 8, 'c1', 2, 1)]
    """
    out = []
    seed = req.sampling.seed
    for i in range(n):
        sampling = req.sampling.model_copy(update={"seed": None if seed is None else (seed + i) % (1 << 64)})
        out.append(replace(req, request_id=f"{req.request_id}-{i}", share_prompt=req.request_id, share_prompt_n=n,
                           sampling=sampling, n=1))
    return out


def _sum_spec(blocks: list[dict]) -> dict:
    """The choices' `speculative` blocks added up (counts; rates recomputed from them)."""
    out = dict(blocks[0])
    for k in ("drafts", "drafted_tokens", "accepted_tokens"):
        if all(isinstance(b.get(k), (int, float)) for b in blocks):
            out[k] = sum(b[k] for b in blocks)
    if out.get("drafted_tokens"):
        out["acceptance_rate"] = out["accepted_tokens"] / out["drafted_tokens"]
    out["per_choice"] = blocks
    return out


def merge_results(rid: str, model: str, results: list[dict], chat: bool, logprobs: bool, tools: bool) -> dict:
    """One response with a choice per result (index i), usage: the prompt once, the completions summed."""
    bodies = [chat_response(rid, model, r, logprobs=logprobs, tools=tools) if chat
              else completion_response(rid, model, r, logprobs=logprobs) for r in results]
    out = bodies[0]
    out["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    usage = dict(results[0]["usage"])
    usage["completion_tokens"] = sum(r["usage"]["completion_tokens"] for r in results)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    out["usage"] = usage
    out["speculative"] = _sum_spec([r["speculative"] for r in results])
    return out


async def generate_choices(pick, req: EngineRequest, body, chat: bool, n: int):
    """IngressRoutes._generate for n > 1 (pick: the request's model_route.Pick: engine, records, arm, model)."""
    engine, records, arm = pick.engine, pick.records, pick.arm
    rid, model = req.request_id, pick.model
    reqs = fan_out(req, n)
    wants = req.sampling.logprobs is not None
    tools = bool(req.tools)
    if not body.stream:
        try:
            results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        except Exception as e:
            err = serve_error(e)
            records.add_error(err.status)
            raise err from None
        for r in results:
            if type(r) is StreamError:
                records.add_error(r.error.status)
                raise r.error
            records.add(r)
        return JSONResponse(merge_results(rid, model, results, chat, wants, tools) | {"arm": arm})
    gens = [engine.stream(r) for r in reqs]
    firsts = []
    try:
        for g in gens:  # an error (a bad field, overload) answers the whole request before the stream starts
            first = await g.__anext__()
            if type(first) is StreamError:
                records.add_error(first.error.status)
                raise first.error
            firsts.append(first)
    except BaseException as e:
        for g in gens:
            g.cancel()
        if isinstance(e, ServeError):
            raise
        err = serve_error(e)
        records.add_error(err.status)
        raise err from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_sse_choices(gens, rid, model, records, chat, include_usage, arm, wants, tools),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_choices(gens, rid: str, model: str, records, chat: bool, include_usage: bool, arm: str,
                       logprobs_on: bool, tools_on: bool):
    """The SSE body of n streams, merged as they come: each delta carries its choice's index."""
    created, tag = now(), {"arm": arm}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, StreamError(serve_error(e))))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    splitters = [ToolCallStream() if tools_on and chat else None for _ in gens]
    calls: list[list] = [[] for _ in gens]
    ends: list[StreamEnd | None] = [None] * len(gens)
    live = len(gens)

    def chunk_of(i: int, delta: dict | str, finish=None, lps=None) -> str:
        if chat:
            c = chat_chunk(rid, model, created, delta, finish, logprobs=lps)
        else:
            c = completion_chunk(rid, model, created, delta, finish, logprobs=lps)
        c["choices"][0]["index"] = i
        return sse(c | tag)

    try:
        if chat:
            for i in range(len(gens)):
                yield chunk_of(i, {"role": "assistant", "content": ""})
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if type(item) is StreamDelta:
                lps = item.logprobs
                if splitters[i] is not None:
                    for p in splitters[i].feed(item.text):
                        yield _part(chunk_of, i, p, calls[i])
                elif chat:
                    yield chunk_of(i, {"content": item.text}, lps=chat_logprobs(lps) if lps else None)
                else:
                    yield chunk_of(i, item.text, lps=completion_logprobs(lps) if lps and logprobs_on else None)
            elif type(item) is StreamEnd:
                records.add(item.summary())
                finish = item.finish_reason
                if splitters[i] is not None:
                    for p in splitters[i].close():
                        yield _part(chunk_of, i, p, calls[i])
                    finish = "tool_calls" if calls[i] and finish == "stop" else finish
                ends[i] = item
                yield chunk_of(i, {} if chat else "", finish)
            elif type(item) is StreamError:
                status, body = openai_error(item.error)
                records.add_error(status)
                yield sse(body)
                return
        done = [e for e in ends if e is not None]
        if include_usage and done:
            usage = dict(done[0].usage)
            usage["completion_tokens"] = sum(e.usage["completion_tokens"] for e in done)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model, "choices": [], "usage": usage} | tag)
    finally:
        for t in tasks:
            t.cancel()
        for g, end in zip(gens, ends):
            if end is None:
                g.cancel()  # a client gone away (or an error): the unfinished choices' slots are freed
    yield sse("[DONE]")


def _part(chunk_of, i: int, p, calls: list) -> str:
    """One ToolCallStream part of choice i as an SSE line (text, or a whole call as a tool_calls delta)."""
    if isinstance(p, str):
        return chunk_of(i, {"content": p})
    calls.append(p)
    return chunk_of(i, {"tool_calls": [{"index": len(calls) - 1} | p]})
