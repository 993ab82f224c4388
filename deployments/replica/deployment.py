"""EngineReplica: the Serve deployment that routes requests into rounds.

Requests come from the ingress as EngineRequests (request.py: already validated, the OpenAI fields
mapped by openai_schema's `to_engine`).

`generate_stream` yields dict chunks:

    {"type": "start", "id", "prompt_tokens", "truncated_prompt_tokens"}
                                                  first, once the request is admitted
    {"type": "delta", "text"}                     new text (merged per wake-up)
    {"type": "end", "finish_reason", "usage", "speculative", "timing"}
                                                  timing: ttft/itl/e2e (s) and the replica's
                                                  stages (ms, metrics.replica_stages)
    {"type": "error", "status", "message", "param", "code"}
                                                  instead of start (400 bad request, 429
                                                  queue full, 503 target restarting) or
                                                  mid-stream (503 target lost, 500 bug)

A caller that goes away (the ingress cancels the stream when its HTTP client
disconnects) cancels the sequence: its slot and KV cells free at the top of
the next round.
"""

from __future__ import annotations

import logging
import time
from time import perf_counter

from ray import serve

from specray.engine.config import ChainConfig

from specray.deployments.ab.arms import DEFAULT_ARM
from specray.deployments.replica.core import RequestError, RouterCore
from specray.deployments.replica.direct import DirectLink
from specray.deployments.replica.metrics import replica_stages
from specray.deployments.replica.request import EngineRequest
from specray.deployments.replica.streams import next_chunk_stamped
from specray.deployments.config import ServeConfig, deep_merge

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
    def __init__(self, config: dict, arm: str = DEFAULT_ARM) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.arm = arm  # the A/B arm this deployment serves (metrics label, /v1/stats)
        self.base_chain = self.cfg.engine.chain  # user_config's chain is read over this one
        self.core = RouterCore(self.cfg)
        try:
            from specray.deployments.replica.metrics import EngineMetrics

            self.core.observer = EngineMetrics(arm, self.cfg.engine.slots)
        except Exception:  # no metrics (e.g. outside Ray): serving goes on
            log.exception("Prometheus metrics unavailable")

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

    async def generate_stream(self, request: EngineRequest, direct: DirectLink | None = None):
        """The request's chunks (module docstring). `direct`: the stream's DirectLink, where the caller runs
        in this process with the client's socket (the fused layout with direct ingress; direct.py): the round
        thread then writes plain deltas to the socket itself and this generator yields only the rest. Each
        chunk it yields has been handed to the transport when the caller asks for the next one, which is when
        the link may be armed."""
        t_start = perf_counter()
        wall_start = time.time()
        try:
            req = self.core.make_request(request)
            t_request = perf_counter()
            seq, queue = await self.core.submit(req, direct=direct)
        except Exception as e:
            yield error_chunk(e)
            return
        done = False
        emit_s, emit_chunks = 0.0, 0  # the emit stage, summed over the delta chunks (two clock reads each)
        numbered = [None] if direct is not None else None  # the number of the last delta taken
        try:
            to_start = perf_counter() - t_start
            yield {"type": "start", "id": seq.id, "prompt_tokens": len(req.prompt_tokens),
                   "truncated_prompt_tokens": getattr(req, "truncated_prompt_tokens", 0)}
            if direct is not None:  # the response's head (and a chat's role chunk) went out before this
                await direct.arm()
            while True:
                lps: dict[str, list] = {"logprobs": [], "prompt_logprobs": []}
                text, term, t_made = await next_chunk_stamped(queue, lps, numbered)
                if text or lps["logprobs"] or lps["prompt_logprobs"]:
                    if t_made is not None:
                        emit_s += perf_counter() - t_made
                        emit_chunks += 1
                    yield {"type": "delta", "text": text} | {k: v for k, v in lps.items() if v}
                    if direct is not None:
                        direct.consumed_upto(numbered[0])
                        if term is None:
                            await direct.arm()
                if term is not None and term["type"] == "raw":  # the rest of a chunk the socket did not take
                    direct.write_raw(term["data"])
                    direct.consumed_upto(term["n"])
                    await direct.arm()
                    continue
                if term is not None:
                    done = True
                    if term["type"] == "end":  # the ingress adds its own stages (once per request)
                        if direct is not None:  # the deltas the round thread wrote itself
                            term["timing"] |= direct.timing()
                        term["timing"] |= replica_stages(t_start, t_request, seq.t_admit, seq.t_first_token,
                                                         seq.t_finish, perf_counter(), emit_s, emit_chunks,
                                                         to_start)
                        term["timing"]["wall"] = {"replica_start": wall_start, "replica_end": time.time()}
                    yield term
                    return
        finally:
            if not done:  # the caller went away (or we were cancelled): free the slot
                self.core.cancel(seq)

    async def generate(self, request: EngineRequest) -> dict:
        """The whole result at once: {"id", "text", "finish_reason", "usage", "speculative"} or an error chunk."""
        parts: list[str] = []
        lps: list = []  # the tokens' logprob entries (streams.logprob_entries), where asked for
        plps: list = []  # echo: the prompt tokens' entries
        start: dict = {}
        async for chunk in self.generate_stream(request):
            t = chunk["type"]
            if t == "start":
                start = chunk
            elif t == "delta":
                parts.append(chunk["text"])
                lps.extend(chunk.get("logprobs", ()))
                plps.extend(chunk.get("prompt_logprobs", ()))
            elif t == "error":
                return chunk
            elif t == "end":
                return {"type": "result", "id": start.get("id"), "text": "".join(parts), "logprobs": lps,
                        "prompt_logprobs": plps} | {
                    k: chunk[k] for k in ("finish_reason", "usage", "speculative", "timing")
                }
        return {"type": "error", "status": 500, "message": "stream ended without a result", "param": None,
                "code": None}

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
