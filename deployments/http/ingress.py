"""The OpenAI-compatible HTTP ingress (FastAPI on Serve).

POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health,
GET /v1/stats (replica counters: rounds, the target's multi-sequence decodes,
the actor hop, speculators, slots, KV cells per slot, cancellations, actor
restarts, RSS; under `arms`, each A/B arm's figures: request records and
totals kept here, engine counters summed over the arm's replicas).

The routes live in `IngressRoutes`, over one engine link per model and arm
(engine_link.py, model_route.py). A request's `model` (an id or an alias, else
the default model) picks the model in a multi-model app; an unknown one is a
404 (deployments/models/directory.py). Split layout: the `Ingress` deployment below serves them in
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

from specray.deployments import heap
from specray.deployments.ab.stats import merge_snapshots
from specray.deployments.ab.arms import ARM_HEADER, SESSION_HEADER
from specray.deployments.models.config import model_configs
from specray.deployments.models.directory import SPLIT_ARM_PREFIX, ModelDirectory
from specray.deployments.replica.errors import BadRequest, EngineFailure, ServeError, Unavailable
from specray.deployments.replica.request import EngineRequest, replace
from specray.deployments.replica.stream_items import StreamError
from specray.deployments.http.direct_response import DirectStreamingResponse
from specray.deployments.http.engine_link import HandleEngine
from specray.deployments.http.model_route import ModelRoute, Pick, worst
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


#: how long /health (and the multi-model probe) waits for one engine deployment's answer before it counts that
#: model's arm as failed
HEALTH_TIMEOUT_S = 10.0
#: a multi-model app's ingress asks every model's health this often, so requests for a model that cannot serve
#: (no replica could start) get a 503 at once instead of waiting in Serve's queue for a replica
PROBE_INTERVAL_S = 5.0


def _truncation_header(n: int) -> dict | None:
    """Prompt truncation (prompt_overflow: truncate) is said in a header as well as in usage."""
    return {"X-Specray-Prompt-Truncated": str(n)} if n else None




class IngressRoutes:
    """The routes, the model directory and each model's arm table, over links to the engines
    (deployments/http/engine_link.py). Two deployments serve them (deployments/app.py): `Ingress` below (split
    layout: the engines are other deployments, reached through handles) and `FusedReplica`
    (deployments/fused.py: one model's one arm, its engine in the same replica, called in-process)."""

    #: one ingress replica: /v1/stats' records are this replica's own (no broadcast to the others)
    solo = True
    #: ServeConfig.layout this deployment serves (/v1/stats -> ingress.layout)
    layout = "split"

    def __init__(self, engines: dict, config: dict) -> None:
        """`engines`: {model id: {arm: EngineLink}}, in the config's model and arm order."""
        self.cfg = ServeConfig.model_validate(config)
        self.directory = ModelDirectory(self.cfg)
        self.routes = {mid: ModelRoute(mid, mcfg, engines[mid], self.cfg.arm_salt, self.cfg.stats_max_records)
                       for mid, mcfg in model_configs(self.cfg).items()}
        self.default = self.routes[self.directory.default]
        self.created = now()
        configure(self.cfg.api_key, self.cfg.max_body_bytes)
        _set_retry_after(self.cfg.retry_after_s)

    def reconfigure(self, user_config: dict) -> None:
        """Serve's lightweight update (`user_config`, also applied at start): {"weights": {ARM: WEIGHT}}
        changes the traffic split of a one-model app without restarting anything (arms not named keep their
        configured weight); {"weights": {MODEL: {ARM: WEIGHT}}} that of each model named."""
        unknown = sorted(set(user_config or {}) - {"weights"})
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown} (the Ingress takes 'weights')")
        weights = (user_config or {}).get("weights")
        if not weights:
            return
        per_model = weights if self.cfg.models else {self.default.id: weights}
        for name, w in per_model.items():
            route = self.routes[self.directory.resolve(name)]
            route.arms.set_weights(route.init_weights | w)
            log.info("model %s: arm weights now %s", route.id, route.arms.shares())

    def _pick(self, request: Request, body) -> Pick:
        """The model (body.model, an alias, the default; a split may divert) and arm that answer a request; a
        503 (model_unavailable) for a model whose last health probe found nothing serving."""
        pick = self._route(request, body)
        if len(self.routes) > 1:
            self._start_probe()
            down = self.routes[pick.model].down
            if down is not None:
                raise Unavailable(f"model {pick.model!r} is not serving: {down}", param="model",
                                  code="model_unavailable")
        return pick

    def _start_probe(self) -> None:
        """Ask every model's health every PROBE_INTERVAL_S from now on (started by the first request, on the
        event loop that serves it)."""
        if getattr(self, "_probe", None) is None:
            self._probe = asyncio.get_running_loop().create_task(self._probe_models())

    async def _probe_models(self) -> None:
        while True:
            for route in self.routes.values():
                try:
                    await route.health(HEALTH_TIMEOUT_S)
                except Exception:  # the probe must outlive anything one model does
                    log.exception("health probe of model %s failed", route.id)
            await asyncio.sleep(PROBE_INTERVAL_S)

    def _route(self, request: Request, body) -> Pick:
        forced = request.headers.get(ARM_HEADER)
        key = body.user or request.headers.get(SESSION_HEADER) or None
        asked, serving = self.directory.route(body.model, key)
        route = self.routes[asked]
        if serving != asked and forced is None:
            return route.diverted(self.routes[serving], key)
        try:
            return route.pick(forced.strip() if forced is not None else None, key)
        except ValueError as e:
            raise BadRequest(f"{e} (header X-Specray-Arm)", param="X-Specray-Arm", code="unknown_arm") from None

    # ---- info -----------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self):
        """Every model: its id, aliases, chain (the first arm's), arms, target memory and placement."""
        data = []
        for route in self.routes.values():
            data.append({
                "id": route.id, "object": "model", "created": self.created, "owned_by": "specray",
                "aliases": self.directory.aliases_of(route.id),
                "default": route is self.default,
                "mode": route.cfg.mode, "chain": route.chains[route.arms.names[0]],
                # attention, recurrent or hybrid, and the rollback mode of drafts (engine/rollback.py)
                "memory": await route.target_memory(),
                "placement": route.placement(),
                "arms": [{"name": n, "chain": route.chains[n], "weight": w}
                         for n, w in zip(route.arms.names, route.arms.weights)]})
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health(self, model: str | None = None):
        """200 when every model serves (status ok, or degraded: a companion is restarting, so no model
        drafts); 503 while a model's target actor restarts (recovering) or after it could not be restarted
        (failed), or none of its replicas answers. `?model=NAME` checks that model alone (404 if unknown).
        With several models, `models` holds each one's health; the top level is the default model's (or the
        named one's), its status the worst."""
        routes = [self.routes[self.directory.resolve(model)]] if model else list(self.routes.values())
        per_model = {r.id: await r.health(HEALTH_TIMEOUT_S) for r in routes}
        h = dict(per_model[routes[0].id if model else self.default.id])
        h["status"] = worst(m["status"] for m in per_model.values())
        if len(self.routes) > 1:
            h["models"] = per_model
        serving = h["status"] in ("ok", "degraded")
        return JSONResponse(h, status_code=200 if serving else 503, headers=None if serving else _retry_headers())

    @app.get("/v1/stats")
    async def stats(self):
        """The default model's first arm's replica counters at the top level (one replica, as before arms),
        and `arms`: per arm of that model its weight, chain, request totals and records (all ingress
        replicas) and its engine counters summed over its live replicas. With several models, `models`
        holds each model's `arms` block the same way."""
        try:
            top = await self.default.first.stats()
        except Exception as e:
            return _error_response(e)
        records = await self._all_records()
        blocks = {mid: await self._arms_block(route, records) for mid, route in self.routes.items()}
        top["arms"] = blocks[self.default.id]
        if len(self.routes) > 1:
            top["models"] = {mid: {"arms": b, "aliases": self.directory.aliases_of(mid),
                                   "default": mid == self.default.id} for mid, b in blocks.items()}
        top["ingress"] = {"replicas": len(records), "pids": [r["pid"] for r in records],
                          "weights": [r["weights"] for r in records], "layout": self.layout,
                          # ServeConfig.user_code_loop as this process runs it (the env reached it, or not)
                          "user_code_loop": "separate" if serve_constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
                          else "shared",
                          # requests whose engine replica was lost before they produced anything, asked again
                          "retried_after_engine_loss": sum(r.get("retried", 0) for r in records)}
        return top

    @staticmethod
    async def _arms_block(route: ModelRoute, records: list[dict]) -> dict:
        """One model's `arms`: per arm its weight, share, chain, records (merged over ingress replicas) and
        engine counters (summed over the arm's replicas); a split's `@MODEL` arm has records only."""
        engines = await asyncio.gather(*(link.stats_all() for link in route.engines.values()))
        shares = route.arms.shares()
        mine = [r["models"].get(route.id, {}) for r in records]  # this model's arms, per ingress replica

        def merged(name: str) -> dict:
            return merge_snapshots([arms[name] for arms in mine if name in arms])

        out = {
            name: {"weight": w, "share": shares[name], "chain": eng.get("chain") or route.chains[name]}
            | merged(name) | {"engine": eng}
            for (name, w), eng in zip(zip(route.arms.names, route.arms.weights), engines)
        }
        for name in sorted({n for arms in mine for n in arms} - set(out)):  # a split's diverted requests
            to = name[len(SPLIT_ARM_PREFIX):]
            out[name] = {"diverted_to": to, "chain": f"model {to}"} | merged(name)
        return out

    def arm_records(self) -> dict:
        """This ingress replica's per-model, per-arm request records (merged over ingress replicas by
        /v1/stats)."""
        return {"pid": os.getpid(),
                "weights": dict(zip(self.default.arms.names, self.default.arms.weights)),
                "models": {mid: {name: r.snapshot() for name, r in route.records.items()}
                           for mid, route in self.routes.items()},
                "retried": sum(getattr(e, "retried", 0) for route in self.routes.values()
                               for e in route.engines.values())}

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
        pick = self._pick(request, body)
        return await self._generate(body.to_engine(), body, chat=False, pick=pick, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        pick = self._pick(request, body)
        return await self._generate(body.to_engine(), body, chat=True, pick=pick, request=request)

    async def _generate(self, req: EngineRequest, body, chat: bool, pick: Pick, request: Request):
        clock = StreamClock(request.scope)
        rid = new_id("chatcmpl" if chat else "cmpl")
        req = replace(req, request_id=rid)
        if req.n > 1:  # n choices: n engine requests sharing the prompt's cells (choices.py)
            return await generate_choices(pick, req, body, chat, req.n)
        engine, records, arm, model = pick.engine, pick.records, pick.arm, pick.model
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
            body_out = (chat_response(rid, model, result, logprobs=wants, tools=bool(req.tools))
                        if chat else completion_response(rid, model, result, logprobs=wants))
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
        body_iter = sse_body(gen, rid, model, records, chat, include_usage, arm, clock,
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

    def __init__(self, engines: dict, config: dict) -> None:
        # {model id: {arm: DeploymentHandle of that arm's EngineReplica deployment}}, in config order
        super().__init__({m: {arm: HandleEngine(h) for arm, h in arms.items()} for m, arms in engines.items()},
                         config)
        self.solo = self.cfg.ingress_replicas <= 1
        heap.watch()
        if self.cfg.freeze_gc:
            heap.freeze_startup()
