"""Direct writes: the round thread writes a stream's plain deltas straight to the client's socket.

Fused with direct ingress but without them, a streamed token's way out is round thread ->
the replica's event loop -> uvicorn -> socket: one wake-up of the loop per
round, its GIL hand-off, and its Python per chunk. On a node whose cores all
decode (say 2 cores, 2 llama.cpp threads) that wake-up takes a core from the
decode; with nothing going through the loop per round, the serving overhead
a token is much smaller (docs/serving.md).

A `DirectLink` joins one stream's two sides. The loop side (the HTTP
response, deployments/http/direct_response.py) attaches the connection: its
own dup of the socket's fd, a check that the transport has nothing buffered,
and the transport's write for raw bytes. The round thread `offer`s each plain
delta: while the link is armed it frames the delta's SSE line as an HTTP/1.1
chunk (`b"%x\\r\\n" ... b"\\r\\n"`, as uvicorn frames a body message) and
writes it with one non-blocking `os.write`.

Order on the wire is the order the round thread made the items in:
- the loop arms the link only when every item the round thread posted to it
  has been handed to the transport (`consumed == posted`) and the transport
  has nothing buffered (uvloop writes queued data at the end of a loop
  iteration: `arm` waits one first);
- posting any item (a delta with logprobs, the end, an error) disarms it;
- a write the kernel does not take whole (a slow client, a full send buffer)
  disarms it, and the rest of that chunk is posted as a raw item, written
  through the transport before anything after it. The loop may arm the link
  again once the transport has drained;
- a write that fails (EPIPE, ECONNRESET: the client went away) returns GONE;
  the round thread cancels the sequence.

Every method is thread-safe: `lock` orders the round thread's writes against
the loop's arming and `close`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from time import perf_counter
from typing import Callable

#: offer() outcomes
WRITTEN, POST, RAW, GONE = "written", "post", "raw", "gone"


def chunk_frame(data: bytes) -> bytes:
    r"""One HTTP/1.1 chunk of a chunked body, as uvicorn writes a body message.

    >>> chunk_frame(b"data: x\n\n")
    b'9\r\ndata: x\n\n\r\n'
    """
    return b"%x\r\n%b\r\n" % (len(data), data)


class DirectLink:
    """One stream's way from the round thread to its socket (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.template = None  # the stream's DeltaTemplate (.sse(text) -> the SSE line), set by the SSE body
        self.fd = -1  # our own dup of the connection's socket: never another connection's fd
        self._writable: Callable[[], bool] | None = None  # loop thread: the transport has nothing buffered
        self._write_raw: Callable[[bytes], None] | None = None  # loop thread: transport.write
        self.ready = False  # armed: the round thread may write now
        self.closed = False
        self.posted = 0  # items the round thread posted to the loop for this stream (round thread)
        self.consumed = 0  # the number of the last of them the loop has handed to the transport (loop)
        # what happened, for /v1/stats and the stream's timing
        self.arms = 0
        self.chunks = 0
        self.bytes = 0
        self.write_s = 0.0
        self.partial = 0

    # ---- loop side -------------------------------------------------------------------------------
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

    def consumed_upto(self, n: int | None) -> None:
        """The loop handed the items up to number `n` to the transport."""
        if n is not None and n > self.consumed:
            self.consumed = n

    async def arm(self) -> bool:
        """Let the round thread write, if nothing posted is still on its way and the transport has nothing
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

    def write_raw(self, data: bytes) -> None:
        """Loop: the rest of a chunk the kernel did not take whole, through the transport (after what it holds)."""
        if self._write_raw is not None and not self.closed:
            self._write_raw(data)

    def close(self) -> None:
        """The stream is over (or its caller went away): no write after this; the dup is closed."""
        with self.lock:
            self.closed = True
            self.ready = False
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- round thread ----------------------------------------------------------------------------
    def posting(self) -> int:
        """An item goes to the loop: disarm; returns its number (stamped on the item as "n")."""
        with self.lock:
            self.ready = False
            self.posted += 1
            return self.posted

    def offer(self, text: str) -> tuple[str, bytes | None, int]:
        """Write `text`'s delta now if armed. Returns (WRITTEN, None, 0); (POST, None, n): post it as a delta
        item numbered n; (RAW, rest, n): the kernel took part of the chunk, post `rest` as a raw item
        numbered n; (GONE, None, 0): the connection is broken."""
        with self.lock:
            if not self.ready:
                self.posted += 1
                return POST, None, self.posted
            t0 = perf_counter()
            frame = chunk_frame(self.template.sse(text).encode())
            try:
                n = os.write(self.fd, frame)
            except BlockingIOError:
                n = 0
            except OSError:  # EPIPE, ECONNRESET, EBADF after a close race: nobody reads this stream any more
                self.ready = False
                self.closed = True
                return GONE, None, 0
            self.write_s += perf_counter() - t0
            if n == len(frame):
                self.chunks += 1
                self.bytes += n
                return WRITTEN, None, 0
            self.ready = False
            self.partial += 1
            self.bytes += n
            self.posted += 1
            return RAW, frame[n:], self.posted

    def timing(self) -> dict:
        """The stream's per-chunk figures (http/timing.py): chunks the round thread wrote, mean ms a write."""
        return {"direct_chunks": self.chunks,
                "direct_mean_ms": round(1000.0 * self.write_s / self.chunks, 4) if self.chunks else 0.0}

    def summary(self) -> dict:
        return {"arms": self.arms, "chunks": self.chunks, "bytes": self.bytes, "partial": self.partial,
                "write_ms": round(1000.0 * self.write_s, 3)}
