"""The OpenAI-compatible HTTP ingress (FastAPI on Serve).

POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health,
GET /v1/stats (replica counters: rounds, the target's multi-sequence decodes,
the actor hop, speculators, slots, KV cells per slot, cancellations, actor
restarts, RSS).

Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 for bad input (FastAPI's 422 validation errors included; malformed JSON,
non-UTF-8 bodies, an unknown `X-Specray-Arm`), 401 without the API key (when
one is configured; see http_guard), 413 for a body over max_body_bytes, 429
when the replica's queue is full and 503 when Serve sheds load or the target
actor is restarting (both with Retry-After), 500 for bugs. A stream that fails
after it started ends with an error event, then `data: [DONE]`.
"""

# no `from __future__ import annotations` here: Serve rebuilds the route signatures and FastAPI
# must see real classes, not strings, or bodies turn into query parameters
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from .http_guard import Guard, configure
from .openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    now,
)
from .serve_config import ServeConfig

log = logging.getLogger("specray.ingress")

app = FastAPI(title="specray", description="Speculative-decoding LLM server (OpenAI-compatible)")
app.add_middleware(Guard)  # API key, body size limit, UTF-8: before any parsing

#: A/B arms (header X-Specray-Arm): only the default arm exists until arms are configurable
ARM_HEADER = "x-specray-arm"
ARMS = ("default",)
#: 429 / 503 answers carry Retry-After (seconds); set from the config at start
_retry_after = {"s": 1}


def _set_retry_after(seconds: int) -> None:
    # a module function, so the replica's Ingress (pickled by value by serve.ingress, globals and all)
    # changes this module's setting, not a copy of it
    _retry_after["s"] = seconds


def _retry_headers() -> dict:
    return {"Retry-After": str(_retry_after["s"])}


def _error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = _retry_headers() if status in (429, 503) else None
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    msgs = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msgs.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(msgs), param


@app.exception_handler(RequestValidationError)
async def _on_validation_error(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return _error_response(message, 400, param)


@app.exception_handler(OpenAIError)
async def _on_openai_error(request: Request, exc: OpenAIError):
    return _error_response(str(exc), exc.status, exc.param, exc.code)


@app.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, exc: StarletteHTTPException):
    return _error_response(str(exc.detail), exc.status_code)


@app.exception_handler(Exception)
async def _on_bug(request: Request, exc: Exception):
    log.exception("unhandled error")
    return _error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


def _check_arm(request: Request) -> None:
    arm = request.headers.get(ARM_HEADER)
    if arm is not None and arm.strip() not in ARMS:
        raise OpenAIError(f"unknown arm {arm.strip()!r} in X-Specray-Arm; known: {', '.join(ARMS)}",
                          param="X-Specray-Arm", code="unknown_arm")


def _truncation_header(n: int) -> dict | None:
    """Prompt truncation (prompt_overflow: truncate) is said in a header as well as in usage."""
    return {"X-Specray-Prompt-Truncated": str(n)} if n else None


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


#: handle errors that mean "try again later", not a bug: Serve's back-pressure, a replica that died or is
#: being replaced
_UNAVAILABLE = ("BackPressureError", "DeploymentUnavailableError", "RayActorError", "ActorDiedError",
                "ActorUnavailableError")


def _handle_error(e: Exception) -> OpenAIError:
    """Errors raised by a handle call (the replica itself answers bad requests with error chunks)."""
    name = type(e).__name__
    if name == "BackPressureError":
        return OpenAIError(f"server overloaded: {e}", 503, code="overloaded")
    if name in _UNAVAILABLE:
        return OpenAIError(f"engine unavailable: {name}: {e}", 503, code="engine_unavailable")
    log.exception("engine call failed")
    return OpenAIError(f"internal error: {name}: {e}", 500)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, engine, config: dict) -> None:
        self.engine = engine  # DeploymentHandle of EngineReplica
        self.cfg = ServeConfig.model_validate(config)
        self.model_id = self.cfg.model_id
        self.created = now()
        configure(self.cfg.api_key, self.cfg.max_body_bytes)
        _set_retry_after(self.cfg.retry_after_s)

    # ---- info -----------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "specray",
             "mode": self.cfg.mode, "chain": self.cfg.engine.chain.label}]}

    @app.get("/health")
    async def health(self):
        """200 when serving (status ok, or degraded: the companion is restarting, so no model drafts);
        503 while the target actor restarts (recovering) or after it could not be restarted (failed)."""
        try:
            h = await self.engine.health.remote()
        except Exception as e:
            return _error_response(f"unhealthy: {type(e).__name__}: {e}", 503)
        serving = h.get("status") in ("ok", "degraded")
        return JSONResponse(h, status_code=200 if serving else 503, headers=None if serving else _retry_headers())

    @app.get("/v1/stats")
    async def stats(self):
        try:
            return await self.engine.stats.remote()
        except Exception as e:
            raise _handle_error(e) from None

    # ---- generation -------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        _check_arm(request)
        req = body.to_engine()
        return await self._generate(req, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        _check_arm(request)
        req = body.to_engine()
        return await self._generate(req, body, chat=True)

    async def _generate(self, req: dict, body, chat: bool):
        rid = new_id("chatcmpl" if chat else "cmpl")
        req["request_id"] = rid
        if not body.stream:
            try:
                result = await self.engine.generate.remote(req)
            except Exception as e:
                raise _handle_error(e) from None
            if result["type"] == "error":
                return _error_response(result["message"], result["status"], result.get("param"), result.get("code"))
            build = chat_response if chat else completion_response
            return JSONResponse(build(rid, self.model_id, result),
                                headers=_truncation_header(result["usage"].get("truncated_prompt_tokens", 0)))

        gen = self.engine.options(stream=True).generate_stream.remote(req)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise OpenAIError("the engine ended the stream without an answer", 500) from None
        except Exception as e:
            gen.cancel()
            raise _handle_error(e) from None
        if first["type"] == "error":
            return _error_response(first["message"], first["status"], first.get("param"), first.get("code"))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            self._sse_stream(gen, rid, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            | (_truncation_header(first.get("truncated_prompt_tokens", 0)) or {}),
        )

    async def _sse_stream(self, gen, rid: str, chat: bool, include_usage: bool):
        created = now()
        model = self.model_id
        finished = False
        try:
            if chat:
                yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            async for chunk in gen:
                t = chunk["type"]
                if t == "delta":
                    if chat:
                        yield _sse(chat_chunk(rid, model, created, {"content": chunk["text"]}))
                    else:
                        yield _sse(completion_chunk(rid, model, created, chunk["text"]))
                elif t == "end":
                    last = (chat_chunk(rid, model, created, {}, chunk["finish_reason"]) if chat
                            else completion_chunk(rid, model, created, "", chunk["finish_reason"]))
                    if include_usage:
                        yield _sse(last)
                        yield _sse({"id": rid, "object": last["object"], "created": created, "model": model,
                                    "choices": [], "usage": chunk["usage"], "speculative": chunk["speculative"]})
                    else:
                        last["usage"] = chunk["usage"]
                        last["speculative"] = chunk["speculative"]
                        yield _sse(last)
                    finished = True
                elif t == "error":
                    yield _sse(error_body(chunk["message"], chunk["status"], chunk.get("param"), chunk.get("code")))
                    finished = True
                    break
        except Exception as e:
            err = _handle_error(e)
            yield _sse(error_body(str(err), err.status))
            finished = True
        finally:
            if not finished:
                gen.cancel()  # the client went away: the replica frees the slot
        yield _sse("[DONE]")
