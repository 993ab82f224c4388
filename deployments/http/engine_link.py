"""How the ingress routes reach an arm's engine: one small interface, two ways.

An engine link has

    await link.generate(req) -> dict | StreamError    EngineReplica.generate
    link.stream(req) -> async iterator          EngineReplica.generate_stream's items, with .cancel()
    await link.health() -> dict                 EngineReplica.health
    await link.stats() -> dict                  one replica's counters (EngineReplica.stats)
    await link.stats_all() -> dict              counters summed over the arm's live replicas

`HandleEngine` (here) goes through a Serve handle to the arm's own engine
deployment (split layout, A/B). `InProcessEngine` (deployments/fused.py) calls
the engine replica living in the same process (fused layout: one arm, no
hop between ingress and engine).
"""

from __future__ import annotations

import asyncio

from specray.deployments.ab.stats import aggregate_replicas
from specray.deployments.replica.request import EngineRequest  # a frozen dataclass: pickled across the handle

#: handle errors that mean "the replica is gone or not there yet", not a bug: one died (its node lost, or
#: killed) or is being replaced. Serve's back-pressure is not one: an overloaded arm is answered at once.
LOST = ("DeploymentUnavailableError", "RayActorError", "ActorDiedError", "ActorUnavailableError")

#: a request the engine lost before it produced anything is asked again this many times, this far apart:
#: Serve's router drops a dead replica from its choices, so the retry lands on a live one (greedy output is
#: the same; a seeded sampled one too). Past that, the client gets 503 + Retry-After.
RETRIES, RETRY_DELAY_S = 2, 0.5


def engine_lost(e: BaseException) -> bool:
    """Whether a handle call failed because its replica is gone (retry elsewhere), not because of the request.

    >>> engine_lost(type("ActorDiedError", (Exception,), {})())
    True
    >>> engine_lost(ValueError("bad"))
    False
    """
    return type(e).__name__ in LOST


class RetryingStream:
    """A replica's stream that is asked again while nothing has come out of it: a replica lost before its
    first chunk (its node went away mid-routing) costs the client a short wait, not an error. Once a chunk has
    gone out, a loss is the caller's to report (the stream's error event)."""

    def __init__(self, start, retries: int = RETRIES, delay_s: float = RETRY_DELAY_S, on_retry=None) -> None:
        self._start, self._retries, self._delay_s, self._on_retry = start, retries, delay_s, on_retry
        self._gen = start()
        self.retried = 0
        self._it = self._chunks()

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._it.__anext__()

    def cancel(self) -> None:
        self._gen.cancel()

    async def _chunks(self):
        while True:
            started = False
            try:
                async for chunk in self._gen:
                    started = True
                    yield chunk
                return
            except Exception as e:
                if started or not engine_lost(e) or self.retried >= self._retries:
                    raise
            self.retried += 1
            if self._on_retry:
                self._on_retry()
            await asyncio.sleep(self._delay_s)
            self._gen = self._start()


class HandleEngine:
    """An arm's engine deployment behind a DeploymentHandle (every call is a Serve request)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.retried = 0  # requests asked again after their replica was lost (/v1/stats ingress)

    def _count_retry(self) -> None:
        self.retried += 1

    async def generate(self, req: EngineRequest) -> dict:
        retried = 0
        while True:
            try:
                return await self.handle.generate.remote(req)
            except Exception as e:  # a lost replica answered nothing: ask again (see RETRIES)
                if not engine_lost(e) or retried >= RETRIES:
                    raise
            retried += 1
            self._count_retry()
            await asyncio.sleep(RETRY_DELAY_S)

    def stream(self, req: EngineRequest) -> RetryingStream:
        # a DeploymentResponseGenerator underneath: async iteration, and cancel() frees the replica's slot
        return RetryingStream(lambda: self.handle.options(stream=True).generate_stream.remote(req),
                              on_retry=self._count_retry)

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
