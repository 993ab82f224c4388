"""Sinks: where the round thread delivers each stream's items, knowing no transport.

The round thread calls, per stream, `sink.write(delta)` for each round's new text, then `sink.end(item)` or
`sink.error(item)` once (stream_items.py). `LoopSink` (here) is the loop path: the items go to the stream's
asyncio queue, each event loop getting a round's items with one `call_soon_threadsafe` (the `Outbox`,
flushed once per round), and its async generator `items()` gives them to the replica's `generate_stream`.
The direct socket writer (deployments/http/socket_sink.py) is a LoopSink that writes plain deltas to the
client's socket itself, and queues only the rest.

>>> import asyncio
>>> async def demo():
...     outbox = Outbox()
...     sink = LoopSink()
...     sink.open(outbox)
...     sink.write(StreamDelta("Par", t=1.0)); sink.write(StreamDelta("is", t=2.0))  # one round's output
...     outbox.flush()
...     await asyncio.sleep(0)  # the loop runs the round's batch
...     return await next_chunk(sink)
>>> asyncio.run(demo())
('Paris', None)
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from .stream_items import StreamDelta, StreamEnd, StreamError, merge


class Sink(Protocol):
    """One stream's way out of the round thread (called on the round thread only)."""

    def write(self, delta: StreamDelta) -> bool:
        """Deliver new text; False when nobody reads the stream any more (the round thread cancels it)."""

    def end(self, item: StreamEnd) -> None:
        """The last item of a finished stream."""

    def error(self, item: StreamError) -> None:
        """The last item of a failed stream."""


def call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class Outbox:
    """The items one round made, per event loop (round thread only); `flush` hands each loop its batch."""

    def __init__(self) -> None:
        self.batches: dict[asyncio.AbstractEventLoop, list] = {}

    def add(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        batch = self.batches.get(loop)
        if batch is None:
            batch = self.batches[loop] = []
        batch.append((queue, item))

    def flush(self) -> None:
        batches, self.batches = self.batches, {}
        for loop, items in batches.items():
            call_in_loop(loop, deliver, items)


class LoopSink:
    """The loop path: items through the stream's asyncio queue. Made on the caller's event loop; the router
    core `open`s it with its Outbox when it accepts the stream."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.outbox: Outbox | None = None

    def open(self, outbox: Outbox) -> None:
        self.outbox = outbox

    # ---- round thread ----------------------------------------------------------------------------
    def post(self, item) -> None:
        self.outbox.add(self.loop, self.queue, item)

    def write(self, delta: StreamDelta) -> bool:
        self.post(delta)
        return True

    def end(self, item: StreamEnd) -> None:
        self.post(item)

    def error(self, item: StreamError) -> None:
        self.post(item)

    # ---- event loop ------------------------------------------------------------------------------
    async def take(self) -> tuple[StreamDelta | None, object | None, int]:
        """Wait for the next item, then take whatever else is queued already: (the deltas taken merged, None
        if they say nothing; the item that stopped the take, None if the queue ran dry; the number of items
        taken). Anything but a delta stops a take: the end, an error, or a sink's own item."""
        item = await self.queue.get()
        if type(item) is not StreamDelta:
            return None, item, 1
        if self.queue.empty():  # the common case: one round's plain delta, nothing to merge
            if item.logprobs is None and item.prompt_logprobs is None:
                return (item if item.text else None), None, 1
            return merge([item]), None, 1
        deltas = [item]
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if type(item) is not StreamDelta:
                return merge(deltas), item, len(deltas) + 1
            deltas.append(item)
        return merge(deltas), None, len(deltas)

    async def items(self):
        """The stream's items as the caller reads them: deltas (merged per read), then the end or error."""
        while True:
            delta, last, _ = await self.take()
            if delta is not None:
                yield delta
            if last is not None:
                yield last
                return

    def timing(self) -> dict:
        """The transport's own figures for the end item's timing (none on the loop path)."""
        return {}


async def next_chunk(sink: LoopSink) -> tuple[str, StreamEnd | StreamError | None]:
    """(the text of the next read, the end or error item if the read reached it)."""
    delta, last, _ = await sink.take()
    return (delta.text if delta is not None else ""), last
