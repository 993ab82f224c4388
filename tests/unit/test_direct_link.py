"""DirectLink (deployments/replica/direct.py) on real sockets: a connected pair, the server end non-blocking as
uvloop leaves a connection. What the peer reads must be exactly the chunks in the order the round thread made
them, whichever of the link or the loop wrote each."""

from __future__ import annotations

import asyncio
import doctest
import os
import socket
import threading

import pytest

from specray.deployments.http import direct_response
from specray.deployments.replica import direct
from specray.deployments.replica.direct import GONE, POST, RAW, WRITTEN, DirectLink, chunk_frame


class Template:
    """DeltaTemplate's one method."""

    def sse(self, text: str) -> str:
        return f"data: {text}\n\n"


def frame(text: str) -> bytes:
    return chunk_frame(f"data: {text}\n\n".encode())


@pytest.fixture
def pair():
    server, client = socket.socketpair()
    server.setblocking(False)
    yield server, client
    server.close()
    client.close()


def linked(server: socket.socket, writable=lambda: True, raw: list | None = None) -> DirectLink:
    link = DirectLink()
    link.template = Template()
    assert link.attach(server.fileno(), writable, (raw if raw is not None else []).append)
    return link


def read_all(client: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += client.recv(n - len(out))
    return out


def test_doctests():
    for module in (direct, direct_response):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


def test_unarmed_offers_are_posted_numbered_and_arming_waits_for_them(pair):
    server, client = pair
    link = linked(server)
    assert link.offer("a") == (POST, None, 1)
    assert link.offer("b") == (POST, None, 2)
    assert not asyncio.run(link.arm())  # two items on their way to the loop: not before they are written
    link.consumed_upto(1)
    assert not asyncio.run(link.arm())
    link.consumed_upto(2)
    assert asyncio.run(link.arm())
    assert link.offer("c") == (WRITTEN, None, 0)
    assert read_all(client, len(frame("c"))) == frame("c")
    assert link.summary() | {"write_ms": 0} == {"arms": 1, "chunks": 1, "bytes": len(frame("c")), "partial": 0,
                                                 "write_ms": 0}


def test_posting_any_item_disarms_until_the_loop_has_written_it(pair):
    server, client = pair
    link = linked(server)
    assert asyncio.run(link.arm())
    n = link.posting()  # e.g. a delta with logprobs, or the end chunk
    assert (n, link.ready) == (1, False)
    assert link.offer("x")[0] == POST  # so "x" cannot overtake the posted item on the wire
    assert not asyncio.run(link.arm())
    link.consumed_upto(2)
    assert asyncio.run(link.arm()) and link.offer("y")[0] == WRITTEN


def test_arming_needs_an_empty_transport(pair):
    server, _ = pair
    state = {"empty": False}
    link = linked(server, writable=lambda: state["empty"])
    assert not asyncio.run(link.arm())
    state["empty"] = True
    assert asyncio.run(link.arm())


def test_a_chunk_the_socket_takes_in_part_is_finished_by_the_loop_in_order(pair):
    """Fill the socket's buffer, then offer: the kernel takes part (or none) of the chunk; the rest comes back
    as RAW for the loop, the link disarms, and the peer reads every byte once and in order."""
    server, client = pair
    raw: list[bytes] = []
    link = linked(server, raw=raw)
    assert asyncio.run(link.arm())
    sent = []
    kind = WRITTEN
    big = "z" * 4000
    while kind == WRITTEN:  # nobody reads: the buffer fills
        kind, rest, n = link.offer(big)
        sent.append(frame(big))
    assert kind == RAW and rest and n == 1 and not link.ready
    assert sent[-1].endswith(rest)
    assert link.offer("after")[0] == POST  # nothing may be written before the rest
    expected = b"".join(sent) + frame("after")
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(read_all(client, len(expected))))
    reader.start()  # the client reads again
    link.write_raw(rest)  # the loop: the rest first (here straight onto the socket, as the transport would)
    server.setblocking(True)
    for data in raw:
        server.sendall(data)
    server.sendall(frame("after"))  # then the posted delta, through uvicorn
    reader.join(30)
    assert bytes(got) == expected
    assert link.summary()["partial"] == 1


def test_a_closed_peer_is_gone(pair):
    server, client = pair
    link = linked(server)
    assert asyncio.run(link.arm())
    client.close()
    kinds = {link.offer("x")[0] for _ in range(3)}  # the first write after the peer left may still succeed
    assert GONE in kinds


def test_close_stops_writes_and_closes_only_the_dup(pair):
    server, client = pair
    link = linked(server)
    assert asyncio.run(link.arm())
    fd = link.fd
    link.close()
    assert link.offer("x")[0] == POST and not asyncio.run(link.arm())
    with pytest.raises(OSError):
        os.fstat(fd)  # the link's dup is closed...
    server.setblocking(True)
    server.sendall(b"ok")  # ...the connection's own fd is not
    assert client.recv(2) == b"ok"


def test_a_blocking_socket_is_refused(pair):
    server, _ = pair
    server.setblocking(True)
    link = DirectLink()
    assert not link.attach(server.fileno(), lambda: True, lambda b: None)
    assert not link.attached and not asyncio.run(link.arm())


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


def test_the_response_closes_its_link_even_when_the_body_never_runs():
    """The head cannot be sent (the client left before it): the body generator never starts, so its `finally`
    cannot close the link; the response must, or the dup of the connection's fd would stay open."""
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
            seen.append(link.attached)  # the response attached the connection before sending the head
            raise OSError("the client went away")

    seen: list[bool] = []

    async def body():
        yield "never"

    link = DirectLink()
    resp = direct_response.DirectStreamingResponse(body(), link=link)
    scope = {"type": "http", "scheme": "http", "http_version": "1.1", "client": list(peer),
             "asgi": {"spec_version": "2.4"}}

    async def receive():
        return {"type": "http.disconnect"}

    with srv, cli, conn:
        with pytest.raises(Exception):
            asyncio.run(resp(scope, receive, Cycle().send))
        assert seen == [True]
        assert link.closed and not link.attached
