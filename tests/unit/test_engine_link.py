"""The ingress asks a lost engine replica's request again only while nothing of it has gone out
(deployments/http/engine_link.py). The node-loss test (tests/cluster) does it on real Ray; here the
handle's stream is stood in for, to pin down each case."""

from __future__ import annotations

import asyncio

import pytest

from specray.deployments.http.engine_link import HandleEngine, RetryingStream, engine_lost

ActorDiedError = type("ActorDiedError", (Exception,), {})
BackPressureError = type("BackPressureError", (Exception,), {})


class FakeGen:
    """A replica stream: yields `chunks`, then raises `fail` (if any)."""

    def __init__(self, chunks, fail=None):
        self.chunks, self.fail, self.cancelled = list(chunks), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.chunks:
            return self.chunks.pop(0)
        if self.fail:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


async def drain(stream):
    return [c async for c in stream]


def starter(*gens):
    made = list(gens)
    return lambda: made.pop(0)


def test_a_replica_lost_before_its_first_chunk_is_asked_again():
    s = RetryingStream(starter(FakeGen([], ActorDiedError("node gone")), FakeGen(["a", "b"])), delay_s=0)
    assert asyncio.run(drain(s)) == ["a", "b"] and s.retried == 1


def test_after_a_chunk_went_out_a_loss_is_the_callers():
    s = RetryingStream(starter(FakeGen(["a"], ActorDiedError("node gone")), FakeGen(["x"])), delay_s=0)
    got = []

    async def run():
        async for c in s:
            got.append(c)

    with pytest.raises(ActorDiedError):
        asyncio.run(run())
    assert got == ["a"] and s.retried == 0


def test_retries_are_bounded_and_back_pressure_is_not_retried():
    s = RetryingStream(starter(*[FakeGen([], ActorDiedError(str(i))) for i in range(3)]), retries=2, delay_s=0)
    with pytest.raises(ActorDiedError, match="2"):
        asyncio.run(drain(s))
    assert s.retried == 2
    s = RetryingStream(starter(FakeGen([], BackPressureError("full")), FakeGen(["a"])), delay_s=0)
    with pytest.raises(BackPressureError):
        asyncio.run(drain(s))
    assert not engine_lost(BackPressureError()) and engine_lost(ActorDiedError())


def test_cancel_reaches_the_stream_in_use():
    first, second = FakeGen([], ActorDiedError("x")), FakeGen(["a", "b"])
    s = RetryingStream(starter(first, second), delay_s=0)

    async def one():
        return await s.__anext__()

    assert asyncio.run(one()) == "a"
    s.cancel()
    assert second.cancelled and not first.cancelled


class FakeHandle:
    """`handle.generate.remote(req)`: fails with each of `errors` in turn, then answers."""

    def __init__(self, errors):
        self.errors, self.calls = list(errors), 0
        self.generate = self

    async def remote(self, req):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"type": "end", "req": req}


def test_generate_asks_again_after_a_lost_replica_but_not_after_a_bad_request(monkeypatch):
    monkeypatch.setattr("specray.deployments.http.engine_link.RETRY_DELAY_S", 0)
    h = FakeHandle([ActorDiedError("gone")])
    link = HandleEngine(h)
    assert asyncio.run(link.generate({"p": 1}))["req"] == {"p": 1} and h.calls == 2 and link.retried == 1
    h = FakeHandle([ValueError("bad")])
    with pytest.raises(ValueError):
        asyncio.run(HandleEngine(h).generate({}))
    assert h.calls == 1
