"""EngineReplica: the Serve deployment that routes requests into rounds.

Request dicts come from the ingress (already validated, OpenAI fields mapped):

    {"prompt": str} | {"prompt_tokens": [int]} | {"messages": [{"role", "content"}]},
    "max_tokens": int, "sampling": {SamplingParams fields}, "stop": [str],
    "chain": [str] | None, "n_max": int | None, "ignore_eos": bool, "request_id": str

`generate_stream` yields dict chunks:

    {"type": "start", "id", "prompt_tokens"}      first, once the request is admitted
    {"type": "delta", "text"}                     new text (merged per wake-up)
    {"type": "end", "finish_reason", "usage", "speculative"}
    {"type": "error", "status", "message", "param"}   instead of start (bad request,
                                                  429 queue full) or mid-stream (500)
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from .router import RequestError, RouterCore, next_chunk
from .serve_config import ServeConfig

log = logging.getLogger("specray.replica")


def error_chunk(e: Exception) -> dict:
    if isinstance(e, RequestError):
        return {"type": "error", "status": e.status, "message": str(e), "param": e.param, "code": e.code}
    if isinstance(e, ValueError):
        return {"type": "error", "status": 400, "message": str(e), "param": None, "code": None}
    log.exception("request failed")
    return {"type": "error", "status": 500, "message": f"internal error: {type(e).__name__}: {e}", "param": None,
            "code": None}


@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(self, config: dict) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.core = RouterCore(self.cfg)

    async def generate_stream(self, request: dict):
        try:
            req = self.core.make_request(request)
            seq, queue = await self.core.submit(req)
        except Exception as e:
            yield error_chunk(e)
            return
        done = False
        try:
            yield {"type": "start", "id": seq.id, "prompt_tokens": len(req.prompt_tokens)}
            while True:
                text, term = await next_chunk(queue)
                if text:
                    yield {"type": "delta", "text": text}
                if term is not None:
                    done = True
                    yield term
                    return
        finally:
            if not done:  # the caller went away (or we were cancelled): free the slot
                self.core.cancel(seq)

    async def generate(self, request: dict) -> dict:
        """The whole result at once: {"id", "text", "finish_reason", "usage", "speculative"} or an error chunk."""
        parts: list[str] = []
        start: dict = {}
        async for chunk in self.generate_stream(request):
            t = chunk["type"]
            if t == "start":
                start = chunk
            elif t == "delta":
                parts.append(chunk["text"])
            elif t == "error":
                return chunk
            elif t == "end":
                return {"type": "result", "id": start.get("id"), "text": "".join(parts)} | {
                    k: chunk[k] for k in ("finish_reason", "usage", "speculative")
                }
        return {"type": "error", "status": 500, "message": "stream ended without a result", "param": None,
                "code": None}

    def stats(self) -> dict:
        return self.core.stats()

    def info(self) -> dict:
        return {"model": self.cfg.model_id, "mode": self.cfg.mode, "n_ctx": self.core.n_ctx,
                "n_ctx_seq": self.core.n_ctx_seq, "slots": self.cfg.engine.slots, "chain": self.cfg.engine.chain.label}

    async def health(self) -> dict:
        await self.check_health()
        return {"status": "ok", "mode": self.cfg.mode}

    async def check_health(self) -> None:
        if not self.core.alive():
            raise RuntimeError("the round thread died")
        if self.core.target_actor is not None:
            await asyncio.wait_for(asyncio.gather(self.core.target_actor.ping.remote(),
                                                  self.core.companion.ping.remote()), timeout=30)

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.close()
