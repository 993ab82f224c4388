"""How the ingress routes reach an arm's engine: one small interface, two ways.

An engine link has

    await link.generate(req) -> result dict     EngineReplica.generate
    link.stream(req) -> async iterator          EngineReplica.generate_stream's chunks, with .cancel()
    await link.health() -> dict                 EngineReplica.health
    await link.stats() -> dict                  one replica's counters (EngineReplica.stats)
    await link.stats_all() -> dict              counters summed over the arm's live replicas

`HandleEngine` (here) goes through a Serve handle to the arm's own engine
deployment (split layout, A/B). `InProcessEngine` (deployments/fused.py) calls
the engine replica living in the same process (fused layout: one arm, no
hop between ingress and engine).
"""

from __future__ import annotations

from specray.deployments.ab.stats import aggregate_replicas


class HandleEngine:
    """An arm's engine deployment behind a DeploymentHandle (every call is a Serve request)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def generate(self, req: dict) -> dict:
        return await self.handle.generate.remote(req)

    def stream(self, req: dict):
        # a DeploymentResponseGenerator: async iteration, and cancel() frees the replica's slot
        return self.handle.options(stream=True).generate_stream.remote(req)

    async def health(self) -> dict:
        return await self.handle.health.remote()

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    async def stats_all(self) -> dict:
        try:
            if hasattr(self.handle, "broadcast"):
                results = await self.handle.broadcast("stats").results_async(timeout_s=30, return_exceptions=True)
            else:  # Ray < 2.60 has no broadcast: one replica's counters
                results = [await self.handle.stats.remote()]
        except Exception as e:
            return {"replicas": 0, "errors": [f"{type(e).__name__}: {e}"]}
        return aggregate_replicas(results)
