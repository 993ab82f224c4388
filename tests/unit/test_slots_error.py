"""A sequence the target could not go on with (engine/rollback.py) ends its caller's stream with a 500 error
item, not an `end`; the text it emitted before went out as usual. A round that fails admitting requests
(a bug) fails them instead of leaving them queued for a round that would fail again."""

from __future__ import annotations

import asyncio

import numpy as np

from specray.deployments.replica.errors import EngineFailure
from specray.deployments.replica.faults import Faults
from specray.deployments.replica.sinks import LoopSink, Outbox
from specray.deployments.replica.slots import ReliabilityStats, Slots
from specray.deployments.replica.stream_items import StreamDelta, StreamError
from specray.deployments.replica.streams import Stream
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.scheduler import Event, Scheduler
from specray.engine.speculators.registry import speculator_factory


def test_a_failed_sequence_ends_its_stream_with_a_500():
    async def make_sink():
        return LoopSink()

    loop = asyncio.new_event_loop()
    try:
        slots = Slots(scheduler=None, rel=ReliabilityStats())
        seq = Sequence(GenerationRequest(np.arange(4, dtype=np.int32), max_tokens=8), (), 0, 12)
        sink = loop.run_until_complete(make_sink())
        sink.open(Outbox())
        slots.streams[seq.id] = Stream(loop, sink)
        slots.event(Event(seq, [5], "hi", False))
        why = "sequence 0: restoring its recurrent state failed: injected"
        seq.finish_reason, seq.error = "error", why
        slots.event(Event(seq, [], "", True, error=why))
        delta, error = [item for _, item in sink.outbox.batches[loop]]
        assert type(delta) is StreamDelta and delta.text == "hi" and delta.plain
        assert type(error) is StreamError and type(error.error) is EngineFailure
        assert (error.error.status, error.error.message, error.error.code) == (500, why, "target_state_error")
        assert seq.id not in slots.streams
    finally:
        loop.close()


class BrokenStart:
    """A target whose start raises: a bug in admitting a request."""

    def start(self, *args, **kwargs):
        raise RuntimeError("injected admission bug")

    def release(self, seq_id, keep=0):
        pass


class Parts:  # what Faults reads of builder.EngineParts
    def __init__(self, scheduler):
        self.scheduler, self.actors = scheduler, None


def test_a_round_that_fails_admitting_fails_the_queued_requests():
    chain = ChainConfig(speculators=[])
    sched = Scheduler(EngineConfig(slots=2, calibrate=False, chain=chain), BrokenStart(), None,
                      Chain(chain, speculator_factory()), n_ctx=256)
    slots = Slots(scheduler=sched, rel=ReliabilityStats())
    faults = Faults(Parts(sched), slots, ReliabilityStats(), "colocated")
    seqs = [sched.submit(GenerationRequest(np.arange(4, dtype=np.int32) + k, max_tokens=8)) for k in range(2)]
    try:
        sched.step()
    except RuntimeError as e:
        faults.round_failed(e)
    assert not sched.queue and not sched.active
    assert all(s.finished and s.finish_reason == "cancelled" for s in seqs)
    assert faults.last_error and "injected admission bug" in faults.last_error
