"""A sequence the target could not go on with (engine/rollback.py) ends its caller's stream with a 500 error
item, not an `end`; the text it emitted before went out as usual."""

from __future__ import annotations

import asyncio

import numpy as np

from specray.deployments.replica.slots import ReliabilityStats, Slots
from specray.deployments.replica.streams import Stream
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.scheduler import Event


def test_a_failed_sequence_ends_its_stream_with_a_500():
    loop = asyncio.new_event_loop()
    try:
        slots = Slots(scheduler=None, rel=ReliabilityStats())
        seq = Sequence(GenerationRequest(np.arange(4, dtype=np.int32), max_tokens=8), (), 0, 12)
        st = Stream(loop, asyncio.Queue())
        slots.streams[seq.id] = st
        out: dict = {}
        slots.event(Event(seq, [5], "hi", False), out)
        why = "sequence 0: restoring its recurrent state failed: injected"
        seq.finish_reason, seq.error = "error", why
        slots.event(Event(seq, [], "", True, error=why), out)
        items = [item for _, item in out[loop]]
        assert items[0]["type"] == "delta" and items[0]["text"] == "hi"
        assert items[1] == {"type": "error", "status": 500, "message": why, "param": None,
                            "code": "target_state_error"}
        assert seq.id not in slots.streams
    finally:
        loop.close()
