"""SocketSink (deployments/http/socket_sink.py) on real sockets: a connected pair, the server end non-blocking as
uvloop leaves a connection. What the peer reads must be exactly the chunks in the order the round thread made
them, whichever of the sink or the loop wrote each."""

from __future__ import annotations

import asyncio
import doctest
import os
import socket
import threading

import pytest

from specray.deployments.http import direct_response, socket_sink
from specray.deployments.http.socket_sink import Rest, SocketSink, chunk_frame
from specray.deployments.replica.errors import ClientGone
from specray.deployments.replica.sinks import Outbox
from specray.deployments.replica.stream_items import StreamDelta, StreamEnd, StreamError


class Template:
    """DeltaTemplate's one method."""

    def sse(self, text: str) -> str:
        return f"data: {text}\n\n"


def frame(text: str) -> bytes:
    return chunk_frame(f"data: {text}\n\n".encode())


def delta(text: str) -> StreamDelta:
    return StreamDelta(text, 0.0)


@pytest.fixture
def pair():
    server, client = socket.socketpair()
    server.setblocking(False)
    yield server, client
    server.close()
    client.close()


def new_sink() -> SocketSink:
    """A sink made on a loop of its own (as the ingress makes it on the replica's), opened on an Outbox."""
    async def make():
        return SocketSink()

    loop = asyncio.new_event_loop()
    sink = loop.run_until_complete(make())
    loop.close()
    sink.open(Outbox())
    return sink


def linked(server: socket.socket, writable=lambda: True, raw: list | None = None) -> SocketSink:
    sink = new_sink()
    sink.template = Template()
    assert sink.attach(server.fileno(), writable, (raw if raw is not None else []).append)
    return sink


def queued(sink: SocketSink) -> list:
    """What the round thread queued for the loop so far."""
    return [item for _, item in sink.outbox.batches.get(sink.loop, [])]


def read_all(client: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += client.recv(n - len(out))
    return out


def test_doctests():
    for module in (socket_sink, direct_response):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


def test_unarmed_writes_are_queued_and_arming_waits_for_them(pair):
    server, client = pair
    sink = linked(server)
    assert sink.write(delta("a")) and sink.write(delta("b"))
    assert [d.text for d in queued(sink)] == ["a", "b"] and sink.posted == 2
    assert not asyncio.run(sink.arm())  # two items on their way to the loop: not before they are written
    sink.consumed = 1
    assert not asyncio.run(sink.arm())
    sink.consumed = 2
    assert asyncio.run(sink.arm())
    assert sink.write(delta("c")) and len(queued(sink)) == 2
    assert read_all(client, len(frame("c"))) == frame("c")
    assert sink.summary() | {"write_ms": 0} == {"arms": 1, "chunks": 1, "bytes": len(frame("c")), "partial": 0,
                                                 "write_ms": 0}


def test_queueing_any_item_disarms_until_the_loop_has_written_it(pair):
    server, client = pair
    sink = linked(server)
    assert asyncio.run(sink.arm())
    sink.write(StreamDelta("with logprobs", 0.0, logprobs=[]))  # not plain: through the loop
    assert (sink.posted, sink.ready) == (1, False)
    assert sink.write(delta("x")) and sink.posted == 2  # so "x" cannot overtake the queued item on the wire
    assert not asyncio.run(sink.arm())
    sink.consumed = 2
    assert asyncio.run(sink.arm()) and sink.write(delta("y")) and sink.chunks == 1
    sink.end(StreamEnd("stop", {}, {}, {}))
    assert (sink.posted, sink.ready) == (3, False)


def test_arming_needs_an_empty_transport(pair):
    server, _ = pair
    state = {"empty": False}
    sink = linked(server, writable=lambda: state["empty"])
    assert not asyncio.run(sink.arm())
    state["empty"] = True
    assert asyncio.run(sink.arm())


def test_a_chunk_the_socket_takes_in_part_is_finished_by_the_loop_in_order(pair):
    """Fill the socket's buffer, then write: the kernel takes part (or none) of the chunk; the rest is queued
    as a Rest for the loop, the sink disarms, and the peer reads every byte once and in order."""
    server, client = pair
    raw: list[bytes] = []
    sink = linked(server, raw=raw)
    assert asyncio.run(sink.arm())
    sent = []
    big = "z" * 4000
    while sink.posted == 0:  # nobody reads: the buffer fills
        assert sink.write(delta(big))
        sent.append(frame(big))
    (rest,) = queued(sink)
    assert type(rest) is Rest and rest.data and not sink.ready
    assert sent[-1].endswith(rest.data)
    sink.write(delta("after"))  # nothing may be written before the rest
    assert sink.posted == 2 and sink.chunks == len(sent) - 1
    expected = b"".join(sent) + frame("after")
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(read_all(client, len(expected))))
    reader.start()  # the client reads again
    server.setblocking(True)
    for data in [rest.data] + raw:  # the loop: the rest first (here straight onto the socket, as the transport would)
        server.sendall(data)
    server.sendall(frame("after"))  # then the queued delta, through uvicorn
    reader.join(30)
    assert bytes(got) == expected
    assert sink.summary()["partial"] == 1


def test_items_write_a_rest_through_the_transport_before_what_follows(pair):
    """The loop side: items() yields deltas, writes a Rest through the transport in its place, counts what it
    handed over (the caller asked for the next item), and stops after the error."""
    server, _ = pair
    raw: list[bytes] = []

    async def main():
        sink = SocketSink()
        sink.template = Template()
        assert sink.attach(server.fileno(), lambda: True, raw.append)
        sink.open(Outbox())
        sink.post(Rest(b"tail"))  # as write() queues one
        sink.post(delta("a"))
        sink.outbox.flush()
        await asyncio.sleep(0)
        got = []
        items = sink.items()
        got.append(await items.__anext__())  # arms first: nothing was queued... then takes the rest and "a"
        assert raw == [b"tail"] and got[0].text == "a" and not sink.ready
        sink.error(StreamError(ClientGone("gone")))
        sink.outbox.flush()
        got.append(await items.__anext__())  # "a" handed over: the error next, every item taken
        assert type(got[1]) is StreamError and sink.consumed == sink.posted == 3
        sink.close()

    asyncio.run(main())


def test_a_closed_peer_is_gone(pair):
    server, client = pair
    sink = linked(server)
    assert asyncio.run(sink.arm())
    client.close()
    results = {sink.write(delta("x")) for _ in range(3)}  # the first write after the peer left may still succeed
    assert False in results


def test_close_stops_writes_and_closes_only_the_dup(pair):
    server, client = pair
    sink = linked(server)
    assert asyncio.run(sink.arm())
    fd = sink.fd
    sink.close()
    assert sink.write(delta("x")) and sink.posted == 1 and not asyncio.run(sink.arm())
    with pytest.raises(OSError):
        os.fstat(fd)  # the sink's dup is closed...
    server.setblocking(True)
    server.sendall(b"ok")  # ...the connection's own fd is not
    assert client.recv(2) == b"ok"


def test_a_blocking_socket_is_refused(pair):
    server, _ = pair
    server.setblocking(True)
    sink = new_sink()
    assert not sink.attach(server.fileno(), lambda: True, lambda b: None)
    assert not sink.attached and not asyncio.run(sink.arm())


def test_find_connection_refuses_what_direct_writes_cannot_serve():
    class Transport:
        def __init__(self, sock, ssl=None):
            self.sock, self.ssl = sock, ssl

        def get_extra_info(self, key):
            return {"socket": self.sock, "sslcontext": self.ssl}[key]

    class Cycle:
        chunked_encoding = None

        def __init__(self, transport):
            self.transport = transport

        async def send(self, message):
            pass

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    cli = socket.create_connection(srv.getsockname())
    conn, peer = srv.accept()
    with srv, cli, conn:
        scope = {"type": "http", "scheme": "http", "http_version": "1.1", "client": list(peer)}
        cyc = Cycle(Transport(conn))
        assert direct_response.find_connection(scope, cyc.send)[0] is cyc
        for bad in ({"scheme": "https"}, {"http_version": "1.0"}, {"client": ["127.0.0.1", 1]}):
            assert direct_response.find_connection(scope | bad, cyc.send) is None, bad
        assert direct_response.find_connection(scope, Cycle(Transport(conn, ssl=object())).send) is None
        assert direct_response.find_connection(scope, print) is None


def test_the_response_closes_its_sink_even_when_the_body_never_runs():
    """The head cannot be sent (the client left before it): the body generator never starts, so its `finally`
    cannot close the sink; the response must, or the dup of the connection's fd would stay open."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    cli = socket.create_connection(srv.getsockname())
    conn, peer = srv.accept()
    conn.setblocking(False)

    class Transport:
        def get_extra_info(self, key):
            return {"socket": conn, "sslcontext": None}[key]

        def write(self, data):
            pass

    class Cycle:
        transport, chunked_encoding, disconnected = Transport(), True, False

        async def send(self, message):
            seen.append(sink.attached)  # the response attached the connection before sending the head
            raise OSError("the client went away")

    seen: list[bool] = []

    async def body():
        yield "never"

    scope = {"type": "http", "scheme": "http", "http_version": "1.1", "client": list(peer),
             "asgi": {"spec_version": "2.4"}}

    async def receive():
        return {"type": "http.disconnect"}

    async def main():
        nonlocal sink
        sink = SocketSink()
        resp = direct_response.DirectStreamingResponse(body(), sink=sink)
        await resp(scope, receive, Cycle().send)

    sink = None
    with srv, cli, conn:
        with pytest.raises(Exception):
            asyncio.run(main())
        assert seen == [True]
        assert sink.closed and not sink.attached
