"""The connection side of direct writes (socket_sink.py): find the connection behind a response's ASGI
`send`, and hand it to the stream's SocketSink.

ASGI gives an app no socket, so the connection is found behind `send`: the
callable Serve's direct ingress passes down (through Starlette's middleware
wrappers and Serve's own) ends in uvicorn's per-request cycle, whose
`transport` is the connection. It is used only where everything checks out:
plain HTTP/1.1 (no TLS: the bytes would bypass it), a chunked response
(uvicorn frames each body message as a chunk, and so does the round thread),
a transport whose socket's peer is the request's client, a non-blocking fd.
Anywhere else (Serve's proxy in front: the replica has no socket of the
client; h11 instead of httptools; another server) `find_connection` returns
None and the stream goes through the event loop as before: slower, never
wrong.
"""

from __future__ import annotations

import os
import socket

from starlette.responses import StreamingResponse

from specray.deployments.http.socket_sink import SocketSink

#: how deep to look through closures and bound methods for uvicorn's cycle
_MAX_DEPTH = 8
#: SO_SNDBUF of a direct-write connection, bytes (unset: the kernel's autotuning, which on loopback grows to
#: megabytes): a cap on the kernel memory a slow client holds, and how the tests make a socket take a chunk in part
SNDBUF_ENV = "SPECRAY_DIRECT_SNDBUF"


def _children(obj) -> list:
    out = []
    self_ = getattr(obj, "__self__", None)
    if self_ is not None:
        out.append(self_)
    func = getattr(obj, "__func__", obj)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return out


def find_cycle(send):
    """uvicorn's request cycle behind an ASGI `send` (an object with `transport` and `chunked_encoding`), or
    None. Breadth-first through bound methods' `__self__` and closures' cells, at most _MAX_DEPTH deep.

    >>> class Cycle:
    ...     transport, chunked_encoding = object(), None
    ...     async def send(self, message): pass
    >>> cyc = Cycle()
    >>> def wrap(inner):
    ...     async def sender(message): await inner(message)
    ...     return sender
    >>> find_cycle(wrap(wrap(cyc.send))) is cyc, find_cycle(wrap(print))
    (True, None)
    """
    seen: set[int] = set()
    level = [send]
    for _ in range(_MAX_DEPTH):
        nxt = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if hasattr(obj, "transport") and hasattr(obj, "chunked_encoding"):
                return obj
            nxt.extend(_children(obj))
        if not nxt:
            return None
        level = nxt
    return None


def _same_address(a, b) -> bool:
    return a is not None and b is not None and tuple(a)[:2] == tuple(b)[:2]


def find_connection(scope: dict, send):
    """(cycle, transport, socket) of this request's connection, where direct writes are safe; else None."""
    if scope.get("type") != "http" or scope.get("scheme") != "http" or scope.get("http_version") != "1.1":
        return None
    cycle = find_cycle(send)
    if cycle is None:
        return None
    transport = cycle.transport
    try:
        if transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or not _same_address(sock.getpeername(), scope.get("client")):
            return None
    except (AttributeError, OSError):
        return None
    return cycle, transport, sock


class DirectStreamingResponse(StreamingResponse):
    """A StreamingResponse that attaches its connection to `sink` before streaming (when find_connection
    finds one); the body (sse.sse_body) and the replica's stream do the rest."""

    def __init__(self, *args, sink: SocketSink, **kw) -> None:
        super().__init__(*args, **kw)
        self.sink = sink

    async def __call__(self, scope, receive, send) -> None:
        conn = find_connection(scope, send)
        if conn is not None:
            cycle, transport, sock = conn

            def writable() -> bool:
                # nothing buffered in the transport, the response started and chunked, the client still there
                return (cycle.chunked_encoding is True and not cycle.disconnected and not transport.is_closing()
                        and transport.get_write_buffer_size() == 0)

            try:
                if os.environ.get(SNDBUF_ENV):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(os.environ[SNDBUF_ENV]))
                self.sink.attach(sock.fileno(), writable, transport.write)
            except OSError:
                pass
        try:
            await super().__call__(scope, receive, send)
        finally:  # the body closes the sink when it ends; a body that never started (head not sent) cannot
            self.sink.close()
