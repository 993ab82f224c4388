"""The fused layout: one arm's engine replica is its own HTTP ingress (one process between Serve's proxy
and the round thread).

In the split layout a streamed token crosses the replica's round thread, its
event loop, a Serve handle stream to the Ingress replica (another process),
the Ingress's event loop, then Serve's HTTP proxy. With one arm there is no
traffic to split, so `FusedReplica` serves the same FastAPI routes
(deployments/http/ingress.py's `IngressRoutes`) from the engine replica
itself: the routes call `EngineReplica.generate_stream` in-process
(`InProcessEngine`), and a token goes round thread -> replica event loop -> SSE
-> proxy. Several arms (A/B) keep the split layout (deployments/app.py).

Every endpoint answers as in the split layout; /v1/stats' `ingress` lists
the fused replicas (each keeps its own request records, merged as ingress
replicas' are). Its `user_config` takes both `chain` (the engine's) and
`weights` (the ingress's; one arm, so only for symmetry with the split
layout).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from specray.deployments.ab.stats import aggregate_replicas
from specray.deployments.config import ServeConfig
from specray.deployments.http.ingress import IngressRoutes, app
from specray.deployments.replica.deployment import EngineReplica
from specray.deployments.replica.request import EngineRequest

log = logging.getLogger("specray.fused")

#: the undecorated replica class: FusedReplica holds one as a plain object
_ReplicaClass = EngineReplica.func_or_class


class LocalStream:
    """EngineReplica.generate_stream's async generator with the handle stream's `cancel()`: a client that
    went away closes the generator, whose `finally` frees the slot."""

    def __init__(self, agen) -> None:
        self._agen = agen

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._agen.__anext__()

    def cancel(self) -> None:
        # called from a `finally` that may not await (the SSE generator being closed): close it as a task
        try:
            asyncio.get_running_loop().create_task(self._agen.aclose())
        except RuntimeError:  # no running loop (interpreter shutdown): the generator's finalizer does it
            pass


class InProcessEngine:
    """The engine link (deployments/http/engine_link.py) to the replica in this process. `peers`: a handle to
    this deployment, to sum the counters of all its replicas (None: this replica is the only one)."""

    def __init__(self, replica, peers_fn=None) -> None:
        self.replica = replica
        self.peers_fn = peers_fn

    async def generate(self, req: EngineRequest) -> dict:
        return await self.replica.generate(req)

    #: the replica runs in this process: a stream may bring its own sink (deployments/http/socket_sink.py)
    in_process = True

    def stream(self, req: EngineRequest, sink=None) -> LocalStream:
        """The replica's stream; `sink`: a LoopSink made on this loop (deployments/replica/sinks.py), None for
        the loop path's own."""
        return LocalStream(self.replica.generate_stream(req, sink=sink))

    async def health(self) -> dict:
        return self.replica.health()

    async def stats(self) -> dict:
        # off the event loop: the counters are read on the round thread between rounds (RouterCore.call), and
        # this loop is the one that streams every running request's tokens
        return await asyncio.to_thread(self.replica.stats)

    async def stats_all(self) -> dict:
        if self.peers_fn is None:
            return aggregate_replicas([await self.stats()])
        try:
            results = await self.peers_fn().broadcast("engine_stats").results_async(
                timeout_s=30, return_exceptions=True)
        except Exception as e:
            return {"replicas": 0, "errors": [f"{type(e).__name__}: {e}"]}
        return aggregate_replicas(results)


def _own_handle():
    ctx = serve.get_replica_context()
    return serve.get_deployment_handle(ctx.deployment, ctx.app_name)


@serve.deployment(name="EngineReplica")
@serve.ingress(app)
class FusedReplica(IngressRoutes):
    """One arm: the engine replica (EngineReplica's code, in-process) and the HTTP routes in one deployment.
    `config`: the full ServeConfig (routes); `engine_config`: the arm's (the engine replica's)."""

    layout = "fused"

    def __init__(self, config: dict, engine_config: dict, arm: str, replicas: int = 1) -> None:
        self.replica = _ReplicaClass(engine_config, arm)
        # several replicas (num_replicas > 1 or autoscaling): /v1/stats gathers records and counters from all
        self.solo = replicas <= 1
        model = ServeConfig.model_validate(engine_config).model_id
        super().__init__({model: {arm: InProcessEngine(self.replica, None if self.solo else _own_handle)}}, config)

    def reconfigure(self, user_config: dict) -> None:
        """Serve's lightweight update: {"chain": ChainConfig fields} (EngineReplica.reconfigure) and
        {"weights": {ARM: WEIGHT}} (IngressRoutes.reconfigure), applied without a restart."""
        uc = user_config or {}
        unknown = sorted(set(uc) - {"chain", "weights"})
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown} (the fused EngineReplica takes 'chain' and "
                             "'weights')")
        super().reconfigure({k: v for k, v in uc.items() if k == "weights"})
        self.replica.reconfigure({k: v for k, v in uc.items() if k == "chain"})

    def engine_stats(self) -> dict:
        """This replica's engine counters (gathered over the replicas by /v1/stats)."""
        return self.replica.stats()

    def check_health(self) -> None:
        self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.core.close()
