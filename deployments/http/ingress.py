"""The OpenAI-compatible HTTP ingress (FastAPI on Serve).

POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health,
GET /v1/stats (replica counters: rounds, the target's multi-sequence decodes,
the actor hop, speculators, slots, KV cells per slot, cancellations, actor
restarts, RSS; under `arms`, each A/B arm's figures: request records and
totals kept here, engine counters summed over the arm's replicas).

The routes live in `IngressRoutes`, over one engine link per arm
(engine_link.py). Split layout: the `Ingress` deployment below serves them in
front of the arms' engine deployments (Serve handles). Fused layout (one arm,
deployments/fused.py): the engine replica serves them itself, in-process.

A/B arms (deployments/ab/arms.py): each arm is its own engine deployment; a
request goes to the arm named by `X-Specray-Arm`, else to the one its `user`
field (or `X-Session-Id` header) hashes to, else to one drawn by weight. The
response names the arm in the same header and in an `arm` field of the JSON
body (every chunk of a stream). Weights change at run time through the
ingress's `user_config` ({"weights": {ARM: WEIGHT}}).

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
import asyncio
import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve._private import constants as serve_constants  # read once at import, as Serve itself does
from starlette.exceptions import HTTPException as StarletteHTTPException

from specray.deployments.ab.stats import ArmRecords, merge_snapshots
from specray.deployments.ab.arms import ARM_HEADER, SESSION_HEADER, ArmTable, resolve_arms
from specray.deployments.replica.errors import BadRequest, EngineFailure, ServeError
from specray.deployments.replica.request import EngineRequest, replace
from specray.deployments.replica.stream_items import StreamError
from specray.deployments.http.direct_response import DirectStreamingResponse
from specray.deployments.http.engine_link import HandleEngine
from specray.deployments.http.errors import openai_error
from specray.deployments.http.guard import Guard, configure
from specray.deployments.http.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_response,
    completion_response,
    new_id,
    now,
)
from specray.deployments.http.socket_sink import SocketSink
from specray.deployments.http.timing import StreamClock, wants_timing
from specray.deployments.http.choices import generate_choices
from specray.deployments.http.sse import sse_body
from specray.deployments.http.tool_calls import ToolCallStream
from specray.deployments.config import ServeConfig

log = logging.getLogger("specray.ingress")

app = FastAPI(title="specray", description="Speculative-decoding LLM server (OpenAI-compatible)")
app.add_middleware(Guard)  # API key, body size limit, UTF-8: before any parsing

#: 429 / 503 answers carry Retry-After (seconds); set from the config at start
_retry_after = {"s": 1}


def _set_retry_after(seconds: int) -> None:
    # a module function, so the replica's Ingress (pickled by value by serve.ingress, globals and all)
    # changes this module's setting, not a copy of it
    _retry_after["s"] = seconds


def _retry_headers() -> dict:
    return {"Retry-After": str(_retry_after["s"])}


def _error_response(e: BaseException, headers: dict | None = None) -> JSONResponse:
    """Any exception as OpenAI's error response (errors.openai_error), with Retry-After on a 429 or 503."""
    status, body = openai_error(e)
    headers = (_retry_headers() if status in (429, 503) else {}) | (headers or {})
    return JSONResponse(body, status_code=status, headers=headers or None)


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
    return _error_response(BadRequest(message, param=param))


# ServeError and Starlette's HTTP errors are answered where they are raised; any other exception is a bug
# (Starlette's server-error handler: answered, then re-raised for the server's log)
@app.exception_handler(ServeError)
@app.exception_handler(StarletteHTTPException)
@app.exception_handler(Exception)
async def _on_error(request: Request, exc: Exception):
    return _error_response(exc)


def _truncation_header(n: int) -> dict | None:
    """Prompt truncation (prompt_overflow: truncate) is said in a header as well as in usage."""
    return {"X-Specray-Prompt-Truncated": str(n)} if n else None




class IngressRoutes:
    """The routes and the A/B arm table, over links to the arms' engines (deployments/http/engine_link.py).
    Two deployments serve them (deployments/app.py): `Ingress` below (split layout: the engines are other
    deployments, reached through handles) and `FusedReplica` (deployments/fused.py: the one arm's engine in
    the same replica, called in-process)."""

    #: one ingress replica: /v1/stats' records are this replica's own (no broadcast to the others)
    solo = True
    #: ServeConfig.layout this deployment serves (/v1/stats -> ingress.layout)
    layout = "split"

    def __init__(self, engines: dict, config: dict) -> None:
        self.cfg = ServeConfig.model_validate(config)
        # {arm: EngineLink of that arm's engine}, in arm order
        self.engines = engines
        arms = resolve_arms(self.cfg)
        self.arms = ArmTable(arms, salt=self.cfg.arm_salt)
        self.init_weights = {a.name: a.weight for a in arms}
        self.chains = {a.name: a.chain_config(self.cfg.engine.chain).label for a in arms}
        self.records = {a.name: ArmRecords(self.cfg.stats_max_records) for a in arms}
        self.engine = self.engines[self.arms.names[0]]  # the first arm: /v1/stats' top level, as before arms
        self.model_id = self.cfg.model_id
        self.created = now()
        configure(self.cfg.api_key, self.cfg.max_body_bytes)
        _set_retry_after(self.cfg.retry_after_s)

    def reconfigure(self, user_config: dict) -> None:
        """Serve's lightweight update (`user_config`, also applied at start): {"weights": {ARM: WEIGHT}}
        changes the traffic split without restarting anything (arms not named keep their configured weight)."""
        unknown = sorted(set(user_config or {}) - {"weights"})
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown} (the Ingress takes 'weights')")
        weights = (user_config or {}).get("weights")
        if weights:
            self.arms.set_weights(self.init_weights | weights)
            log.info("arm weights now %s", self.arms.shares())

    def _pick_arm(self, request: Request, body) -> str:
        forced = request.headers.get(ARM_HEADER)
        key = body.user or request.headers.get(SESSION_HEADER)
        try:
            return self.arms.pick(forced.strip() if forced is not None else None, key or None)
        except ValueError as e:
            raise BadRequest(f"{e} (header X-Specray-Arm)", param="X-Specray-Arm", code="unknown_arm") from None

    # ---- info -----------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "specray",
             "mode": self.cfg.mode, "chain": self.chains[self.arms.names[0]],
             # attention, recurrent or hybrid, and the rollback mode of drafts (engine/rollback.py)
             "memory": await self._target_memory(),
             "arms": [{"name": n, "chain": self.chains[n], "weight": w}
                      for n, w in zip(self.arms.names, self.arms.weights)]}]}

    async def _target_memory(self) -> dict | None:
        """The first arm's target memory (all arms serve one model), asked once of its engine; None while it
        cannot answer (asked again next time)."""
        if getattr(self, "_memory", None) is None:
            try:
                self._memory = (await self.engines[self.arms.names[0]].health()).get("target_memory")
            except Exception:
                return None
        return self._memory

    @app.get("/health")
    async def health(self):
        """200 when serving (status ok, or degraded: the companion is restarting, so no model drafts);
        503 while the target actor restarts (recovering) or after it could not be restarted (failed)."""
        order = ("ok", "degraded", "recovering", "failed")
        per_arm: dict[str, dict] = {}
        for name, handle in self.engines.items():
            try:
                per_arm[name] = await handle.health()
            except Exception as e:
                if len(self.engines) == 1:
                    return _error_response(ServeError(f"unhealthy: {type(e).__name__}: {e}", status=503))
                per_arm[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        # the first arm's fields at the top (as before arms); the status is the worst arm's
        h = dict(per_arm[self.arms.names[0]])
        h["status"] = max((a.get("status", "failed") for a in per_arm.values()),
                          key=lambda st: order.index(st) if st in order else len(order))
        if len(per_arm) > 1:
            h["arms"] = per_arm
        serving = h.get("status") in ("ok", "degraded")
        return JSONResponse(h, status_code=200 if serving else 503, headers=None if serving else _retry_headers())

    @app.get("/v1/stats")
    async def stats(self):
        """The first arm's replica counters at the top level (one replica, as before arms), and `arms`:
        per arm its weight, chain, request totals and records (all ingress replicas) and its engine
        counters summed over its live replicas."""
        try:
            top = await self.engine.stats()
        except Exception as e:
            return _error_response(e)
        records = await self._all_records()
        engines = await asyncio.gather(*(h.stats_all() for h in self.engines.values()))
        shares = self.arms.shares()
        top["arms"] = {
            name: {"weight": w, "share": shares[name], "chain": eng.get("chain") or self.chains[name]}
            | merge_snapshots([r["arms"][name] for r in records if name in r["arms"]]) | {"engine": eng}
            for (name, w), eng in zip(zip(self.arms.names, self.arms.weights), engines)
        }
        top["ingress"] = {"replicas": len(records), "pids": [r["pid"] for r in records],
                          "weights": [r["weights"] for r in records], "layout": self.layout,
                          # ServeConfig.user_code_loop as this process runs it (the env reached it, or not)
                          "user_code_loop": "separate" if serve_constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
                          else "shared",
                          # requests whose engine replica was lost before they produced anything, asked again
                          "retried_after_engine_loss": sum(r.get("retried", 0) for r in records)}
        return top

    def arm_records(self) -> dict:
        """This ingress replica's per-arm request records (merged over ingress replicas by /v1/stats)."""
        return {"pid": os.getpid(), "weights": dict(zip(self.arms.names, self.arms.weights)),
                "arms": {name: r.snapshot() for name, r in self.records.items()},
                "retried": sum(getattr(e, "retried", 0) for e in self.engines.values())}

    async def _all_records(self) -> list[dict]:
        if self.solo:
            return [self.arm_records()]
        try:
            ctx = serve.get_replica_context()
            me = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
            return await me.broadcast("arm_records").results_async(timeout_s=30)
        except Exception:
            log.exception("could not collect the other ingress replicas' records; reporting this one's")
            return [self.arm_records()]

    # ---- generation -------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        arm = self._pick_arm(request, body)
        req = body.to_engine()
        return await self._generate(req, body, chat=False, arm=arm, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arm = self._pick_arm(request, body)
        req = body.to_engine()
        return await self._generate(req, body, chat=True, arm=arm, request=request)

    async def _generate(self, req: EngineRequest, body, chat: bool, arm: str, request: Request):
        clock = StreamClock(request.scope)
        rid = new_id("chatcmpl" if chat else "cmpl")
        req = replace(req, request_id=rid)
        if req.n > 1:  # n choices: n engine requests sharing the prompt's cells (choices.py)
            return await generate_choices(self, req, body, chat, arm, req.n)
        engine, records = self.engines[arm], self.records[arm]
        arm_header = {ARM_HEADER: arm}
        if not body.stream:
            try:
                result = await engine.generate(req)
            except Exception as e:
                return self._failed(records, e)
            if type(result) is StreamError:
                return self._failed(records, result.error, arm_header)
            records.add(result)
            wants = req.sampling.logprobs is not None
            body_out = (chat_response(rid, self.model_id, result, logprobs=wants, tools=bool(req.tools))
                        if chat else completion_response(rid, self.model_id, result, logprobs=wants))
            return JSONResponse(body_out | {"arm": arm},
                                headers=arm_header
                                | (_truncation_header(result["usage"].get("truncated_prompt_tokens", 0)) or {}))

        clock.called()
        direct = self._socket_sink(engine, req, chat)
        gen = engine.stream(req, sink=direct) if direct is not None else engine.stream(req)
        try:
            first = await gen.__anext__()
            clock.first_chunk()
        except StopAsyncIteration:
            return self._failed(records, EngineFailure("the engine ended the stream without an answer"))
        except Exception as e:
            gen.cancel()
            return self._failed(records, e)
        if type(first) is StreamError:
            return self._failed(records, first.error, arm_header)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        body_iter = sse_body(gen, rid, self.model_id, self.records[arm], chat, include_usage, arm, clock,
                             wants_timing(request.headers),
                             logprobs_on=req.sampling.logprobs is not None,
                             tools=ToolCallStream() if chat and req.tools else None, direct=direct)
        kw = dict(media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | arm_header
                  | (_truncation_header(first.truncated_prompt_tokens) or {}))
        if direct is not None:
            return DirectStreamingResponse(body_iter, sink=direct, **kw)
        return StreamingResponse(body_iter, **kw)

    @staticmethod
    def _failed(records, e: BaseException, headers: dict | None = None) -> JSONResponse:
        """A request that failed before its answer started: counted, and answered (errors.openai_error)."""
        response = _error_response(e, headers)
        records.add_error(response.status_code)
        return response

    def _socket_sink(self, engine, req: EngineRequest, chat: bool) -> SocketSink | None:
        """A SocketSink for this stream where the round thread may write its deltas to the client's socket
        (direct writes, socket_sink.py): the engine runs in this process (fused), this process serves HTTP
        itself (Serve's direct ingress: behind Serve's proxy there is no socket here to write to), direct_writes
        is on, and every delta is plain text (no logprobs, echo or tool calls, one choice)."""
        if not (self.cfg.direct_writes and getattr(engine, "in_process", False)
                and serve_constants.RAY_SERVE_ENABLE_DIRECT_INGRESS):
            return None
        s = req.sampling
        if s.logprobs is not None or s.prompt_logprobs or (chat and req.tools):
            return None
        return SocketSink()


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress(IngressRoutes):
    """The split layout's ingress: its own deployment in front of the arms' engine deployments (A/B)."""

    def __init__(self, engines, config: dict) -> None:
        # {arm: DeploymentHandle of that arm's EngineReplica deployment}, in arm order
        handles = engines if isinstance(engines, dict) else {"default": engines}
        super().__init__({arm: HandleEngine(h) for arm, h in handles.items()}, config)
        self.solo = self.cfg.ingress_replicas <= 1
