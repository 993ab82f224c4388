"""A sequence the target could not go on with (engine/rollback.py) ends its caller's stream with a 500 error
item, not an `end`; the text it emitted before went out as usual."""

from __future__ import annotations

import asyncio

import numpy as np

from specray.deployments.replica.errors import EngineFailure
from specray.deployments.replica.sinks import LoopSink, Outbox
from specray.deployments.replica.slots import ReliabilityStats, Slots
from specray.deployments.replica.stream_items import StreamDelta, StreamError
from specray.deployments.replica.streams import Stream
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.scheduler import Event


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
