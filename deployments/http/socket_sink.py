"""The direct socket writer: a sink (deployments/replica/sinks.py) that writes a stream's plain deltas
straight to the client's socket from the round thread.

Through the loop path a streamed token's way out is round thread -> the replica's event loop -> uvicorn ->
socket: one wake-up of the loop per round, its GIL hand-off, and its Python per chunk. On a node whose cores
all decode, that wake-up takes a core from the decode (docs/serving.md). `SocketSink` is a LoopSink whose
`write` of a plain delta, while the sink is armed, frames the delta's SSE line as an HTTP/1.1 chunk
(`b"%x\\r\\n" ... b"\\r\\n"`, as uvicorn frames a body message) and writes it with one non-blocking
`os.write` to its own dup of the connection's fd. Everything else goes through the loop as a LoopSink's
items do. The response (direct_response.py) attaches the connection; the SSE body (sse.py) sets the
stream's `template` and closes the sink when it ends.

Order on the wire is the order the round thread made the items in:
- the loop arms the sink only when every item the round thread queued for it has been handed to the
  transport (`consumed == posted`) and the transport has nothing buffered (uvloop writes queued data at the
  end of a loop iteration: `arm` waits one first);
- queueing any item (a delta with logprobs, the end, an error) disarms it;
- a write the kernel does not take whole (a slow client, a full send buffer) disarms it, and the rest of
  that chunk is queued, written through the transport before anything after it; the loop arms the sink
  again once the transport has drained;
- a write that fails (EPIPE, ECONNRESET: the client went away) makes `write` return False: the round
  thread cancels the sequence.

`lock` orders the round thread's writes against the loop's arming and `close`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from time import perf_counter
from typing import Callable

from specray.deployments.replica.sinks import LoopSink
from specray.deployments.replica.stream_items import StreamDelta


def chunk_frame(data: bytes) -> bytes:
    r"""One HTTP/1.1 chunk of a chunked body, as uvicorn writes a body message.

    >>> chunk_frame(b"data: x\n\n")
    b'9\r\ndata: x\n\n\r\n'
    """
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass(frozen=True, slots=True)
class Rest:
    """The rest of a chunk the socket took in part, queued for the loop to write first."""

    data: bytes


class SocketSink(LoopSink):
    """A stream's sink that writes plain deltas to the client's socket itself (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.template = None  # the stream's DeltaTemplate (.sse(text) -> the SSE line), set by the SSE body
        self.fd = -1  # our own dup of the connection's socket: never another connection's fd
        self._writable: Callable[[], bool] | None = None  # loop thread: the transport has nothing buffered
        self._write_raw: Callable[[bytes], None] | None = None  # loop thread: transport.write
        self.ready = False  # armed: the round thread may write now
        self.closed = False
        self.posted = 0  # items the round thread queued for the loop (round thread)
        self.consumed = 0  # how many of them the loop has handed to the transport (loop)
        # what happened, for /v1/stats and the stream's timing
        self.arms = 0
        self.chunks = 0
        self.bytes = 0
        self.write_s = 0.0
        self.partial = 0

    # ---- loop side: the connection ----------------------------------------------------------------
    def attach(self, fd: int, writable: Callable[[], bool], write_raw: Callable[[bytes], None]) -> bool:
        """Take the connection: `fd` (dup'ed here; the caller keeps its own), `writable()` (the transport's
        buffer is empty and the response is chunked and live), `write_raw(bytes)`. False (nothing taken)
        where the fd blocks: a blocking write would stall every sequence's rounds."""
        own = os.dup(fd)
        if os.get_blocking(own):
            os.close(own)
            return False
        with self.lock:
            if self.closed:
                os.close(own)
                return False
            self.fd, self._writable, self._write_raw = own, writable, write_raw
        return True

    @property
    def attached(self) -> bool:
        return self.fd >= 0

    async def arm(self) -> bool:
        """Let the round thread write, if nothing queued is still on its way and the transport has nothing
        buffered. Cheap to call when it cannot arm (no await then)."""
        if not self.attached or self.closed or self.template is None or self.ready:
            return self.ready
        if self.consumed != self.posted:
            return False
        await asyncio.sleep(0)  # uvloop writes what the transport queued at the end of this loop iteration
        with self.lock:
            if self.closed or self.ready:
                return self.ready
            if self.consumed != self.posted or not self._writable():
                return False
            self.ready = True
            self.arms += 1
        return True

    def close(self) -> None:
        """The stream is over (or its caller went away): no write after this; the dup is closed."""
        with self.lock:
            self.closed = True
            self.ready = False
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    async def items(self):
        """LoopSink.items, arming the sink whenever what was taken has been handed to the transport (the
        caller asks for the next item only then), and writing a Rest through the transport in its place."""
        await self.arm()  # the response's head (and a chat's role chunk) went out before the first read
        while True:
            delta, last, n = await self.take()
            if delta is not None:
                yield delta
            if type(last) is Rest:
                if self._write_raw is not None and not self.closed:
                    self._write_raw(last.data)
                last = None
            self.consumed += n
            if last is not None:
                yield last
                return
            await self.arm()

    # ---- round thread --------------------------------------------------------------------------------
    def post(self, item) -> None:
        """Queue `item` for the loop; it disarms the sink until the loop has handed it over."""
        with self.lock:
            self._post(item)

    def _post(self, item) -> None:
        self.ready = False
        self.posted += 1
        self.outbox.add(self.loop, self.queue, item)

    def write(self, delta: StreamDelta) -> bool:
        """Write a plain delta's chunk now if armed, else queue it; False: the connection is broken."""
        if delta.logprobs is not None or delta.prompt_logprobs is not None:
            self.post(delta)
            return True
        with self.lock:
            if not self.ready:
                self._post(delta)
                return True
            t0 = perf_counter()
            frame = chunk_frame(self.template.sse(delta.text).encode())
            try:
                n = os.write(self.fd, frame)
            except BlockingIOError:
                n = 0
            except OSError:  # EPIPE, ECONNRESET, EBADF after a close race: nobody reads this stream any more
                self.ready = False
                self.closed = True
                return False
            self.write_s += perf_counter() - t0
            if n == len(frame):
                self.chunks += 1
                self.bytes += n
                return True
            self.partial += 1
            self.bytes += n
            self._post(Rest(frame[n:]))
            return True

    # ---- figures -------------------------------------------------------------------------------------
    def timing(self) -> dict:
        """The stream's per-chunk figures (http/timing.py): chunks the round thread wrote, mean ms a write."""
        return {"direct_chunks": self.chunks,
                "direct_mean_ms": round(1000.0 * self.write_s / self.chunks, 4) if self.chunks else 0.0}

    def summary(self) -> dict:
        return {"arms": self.arms, "chunks": self.chunks, "bytes": self.bytes, "partial": self.partial,
                "write_ms": round(1000.0 * self.write_s, 3)}
