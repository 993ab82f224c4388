"""EngineReplica: the Serve deployment that routes requests into rounds.

Requests come from the ingress as EngineRequests (request.py: already validated, the OpenAI fields
mapped by openai_schema's `to_engine`).

`generate_stream` yields typed items (stream_items.py): a StreamStart once the request is admitted, the
StreamDeltas of its new text (merged per read), then a StreamEnd (usage, speculative, timing) or a
StreamError (errors.py). A request refused before it starts (a bad request, a full queue, the target
restarting) yields only a StreamError. For example a two-token answer:

    StreamStart(id=3, prompt_tokens=6), StreamDelta(" Paris"), StreamDelta("."),
    StreamEnd(finish_reason="length", usage={...}, speculative={...}, timing={...})

A caller that goes away (the ingress cancels the stream when its HTTP client
disconnects) cancels the sequence: its slot and KV cells free at the top of
the next round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from time import perf_counter

from ray import serve

from specray.engine.config import ChainConfig

from specray.deployments import heap
from specray.deployments.ab.arms import DEFAULT_ARM
from specray.deployments.replica.core import RouterCore
from specray.deployments.replica.errors import BadRequest, EngineFailure, ServeError
from specray.deployments.replica.metrics import replica_stages
from specray.deployments.replica.request import EngineRequest
from specray.deployments.replica.sinks import LoopSink
from specray.deployments.replica.stream_items import StreamDelta, StreamEnd, StreamError, StreamStart
from specray.deployments.config import ServeConfig, deep_merge

log = logging.getLogger("specray.replica")


def refusal(e: Exception) -> ServeError:
    """What a request that failed before its stream started is answered with: its ServeError, a ValueError
    as a bad request, anything else as a bug (500, logged).

    >>> from specray.deployments.replica.errors import QueueFull
    >>> refusal(ValueError("bad")).status, refusal(QueueFull("full")).status
    (400, 429)
    """
    if isinstance(e, ServeError):
        return e
    if isinstance(e, ValueError):
        return BadRequest(str(e))
    log.error("request failed", exc_info=e)
    return EngineFailure(f"internal error: {type(e).__name__}: {e}")


@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(self, config: dict, arm: str = DEFAULT_ARM) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.arm = arm  # the A/B arm this deployment serves (metrics label, /v1/stats)
        self.base_chain = self.cfg.engine.chain  # user_config's chain is read over this one
        self.core = RouterCore(self.cfg)
        try:
            from specray.deployments.replica.metrics import EngineMetrics

            self.core.observer = EngineMetrics(arm, self.cfg.engine.slots, model=self.cfg.model_id)
        except Exception:  # no metrics (e.g. outside Ray): serving goes on
            log.exception("Prometheus metrics unavailable")
        heap.watch()
        if self.cfg.freeze_gc:  # the engine is up: what is left now lives as long as the process
            heap.freeze_startup()

    def reconfigure(self, user_config: dict) -> None:
        """Serve's lightweight update (the deployment's `user_config`, also applied at start):
        {"chain": ChainConfig fields} sets the arm's chain without restarting the replica. The fields given
        are read over the chain the deployment was built with (per-speculator params merged), so
        `{"chain": {"params": {"suffix": {"p_min": 0.2}}}}` changes just that."""
        unknown = sorted(set(user_config or {}) - {"chain"})
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown} (EngineReplica takes 'chain')")
        if not (user_config or {}).get("chain"):
            return
        new = ChainConfig.model_validate(deep_merge(self.base_chain.model_dump(), user_config["chain"]))
        if new == self.core.chain.config:
            return
        result = self.core.set_chain(new)  # on the round thread, between rounds
        self.cfg = self.core.cfg
        log.info("arm %s: chain updated at run time: %s", self.arm, result)

    async def generate_stream(self, request: EngineRequest, sink: LoopSink | None = None):
        """The request's items (module docstring). `sink`: where the round thread delivers them, made by a
        caller in this process on its own loop (the direct socket writer, deployments/http/socket_sink.py);
        by default a LoopSink. Each item yielded has been taken by the caller when it asks for the next one."""
        t_start = perf_counter()
        wall_start = time.time()
        try:
            req = self.core.make_request(request)
            t_request = perf_counter()
            seq, sink = await self.core.submit(req, sink)
        except Exception as e:
            yield StreamError(refusal(e))
            return
        done = False
        emit_s, emit_chunks = 0.0, 0  # the emit stage, summed over the deltas read (two clock reads each)
        try:
            to_start = perf_counter() - t_start
            yield StreamStart(seq.id, len(req.prompt_tokens), getattr(req, "truncated_prompt_tokens", 0))
            async for item in sink.items():
                if type(item) is StreamDelta:
                    emit_s += perf_counter() - item.t
                    emit_chunks += 1
                    yield item
                    continue
                done = True
                if type(item) is StreamEnd:  # the ingress adds its own stages (once per request)
                    stages = replica_stages(t_start, t_request, seq.t_admit, seq.t_first_token, seq.t_finish,
                                            perf_counter(), emit_s, emit_chunks, to_start)
                    item = replace(item, timing=item.timing | sink.timing() | stages
                                   | {"wall": {"replica_start": wall_start, "replica_end": time.time()}})
                yield item
                return
        finally:
            if not done:  # the caller went away (or we were cancelled): free the slot
                self.core.cancel(seq)

    async def generate(self, request: EngineRequest) -> dict | StreamError:
        """The whole result at once: {"id", "text", "logprobs", "prompt_logprobs", "finish_reason", "usage",
        "speculative", "timing"}, or the StreamError the stream ended in."""
        parts: list[str] = []
        lps: list = []  # the tokens' logprob entries (streams.logprob_entries), where asked for
        plps: list = []  # echo: the prompt tokens' entries
        start: StreamStart | None = None
        async for item in self.generate_stream(request):
            if type(item) is StreamDelta:
                parts.append(item.text)
                lps.extend(item.logprobs or ())
                plps.extend(item.prompt_logprobs or ())
            elif type(item) is StreamStart:
                start = item
            elif type(item) is StreamEnd:
                return {"id": start.id if start is not None else None, "text": "".join(parts), "logprobs": lps,
                        "prompt_logprobs": plps} | item.summary()
            else:
                return item
        return StreamError(EngineFailure("stream ended without a result"))

    def stats(self) -> dict:
        d = self.core.stats()
        d["arm"] = self.arm
        d["chain_config"] = self.core.chain.config.model_dump()
        try:
            d["replica_id"] = serve.get_replica_context().replica_id.unique_id
        except Exception:
            d["replica_id"] = None
        return d

    def info(self) -> dict:
        return {"model": self.cfg.model_id, "mode": self.cfg.mode, "n_ctx": self.core.n_ctx,
                "n_ctx_seq": self.core.n_ctx_seq, "slots": self.cfg.engine.slots, "chain": self.cfg.engine.chain.label}

    def health(self) -> dict:
        """For GET /health: status ok | degraded | recovering | failed, and each actor's state."""
        return self.core.health()

    def check_health(self) -> None:
        """Serve's probe: fail only when this replica cannot recover by itself (a dead round thread,
        a target actor that could not be restarted); Serve then replaces the replica. A target
        being restarted is not a failure here: the replica repairs that itself."""
        if not self.core.alive():
            raise RuntimeError("the round thread died")
        if self.core.target_state() == "failed":
            raise RuntimeError(f"the target actor could not be restarted: {self.core.target_sup.last_error}")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.close()
