"""Per-stage timing of one streamed request, as the ingress sees it (opt-in: `X-Specray-Timing: 1`).

Stages, in request order (ms; each one measured inside ONE process with its
perf_counter, so the servers may be on different hosts):

    ingress_parse  request reached the ingress (Guard, before the body is read) -> engine dict built
                   (body read, JSON, pydantic validation, to_engine)
    handle         ingress's wait from the handle call to the end chunk, minus the replica's own time
                   (replica_ms): the call's way to the replica plus the end chunk's way back (and any
                   wait for the ingress's event loop, busy with other streams)
    tokenize       replica: generate_stream called -> engine request built (chat template, tokens)
    admission      -> the round that gave the sequence its slot
    prefill        -> first token
    decode         -> last token
    emit_tail      last token -> the end chunk yielded by the replica's event loop
    sse_tail       ingress got the end chunk -> the final SSE chunk built
    proxy          client's end-to-end minus ingress_ms (Serve's HTTP proxy, the proxy -> ingress hop,
                   the network): computed by the client, which alone sees both ends

They add up to the client's end-to-end time. Per-chunk figures overlap the
rounds and are not stages: emit_mean_ms x emit_chunks (replica: round thread
produced a delta -> its event loop yielded it), sse_mean_ms x sse_chunks
(ingress: got a delta -> its SSE string built), handle_first_ms (the start
chunk's round trip through the handle, minus the replica's time to it).
`wall` holds time.time() stamps of both processes, for a client on the same
host to split `proxy` and check `handle` (never subtracted across hosts here).
"""

from __future__ import annotations

import time
from time import perf_counter

TIMING_HEADER = "X-Specray-Timing"
#: the additive stages, in order; the client appends "proxy"
SERVER_STAGES = ("ingress_parse", "handle", "tokenize", "admission", "prefill", "decode", "emit_tail", "sse_tail")
#: the ASGI scope keys Guard stamps on arrival (perf_counter, time.time)
SCOPE_T0, SCOPE_WALL0 = "specray.t0", "specray.wall0"


def wants_timing(headers) -> bool:
    return headers.get(TIMING_HEADER, "").strip() in ("1", "true", "yes")


class StreamClock:
    """The ingress's stamps for one streamed request: a few perf_counter reads per request and two per chunk."""

    __slots__ = ("t0", "wall0", "t_call", "wall_call", "first_wait", "t_end", "wall_end", "sse_s", "sse_n")

    def __init__(self, scope: dict) -> None:
        now = perf_counter()
        self.t0 = scope.get(SCOPE_T0, now)  # (a route called without Guard in front: from here)
        self.wall0 = scope.get(SCOPE_WALL0) or time.time()
        self.t_call = now
        self.wall_call = 0.0
        self.first_wait = 0.0
        self.t_end = self.wall_end = 0.0
        self.sse_s, self.sse_n = 0.0, 0

    def called(self) -> None:
        """Engine dict built; the handle call goes out now."""
        self.t_call = perf_counter()
        self.wall_call = time.time()

    def first_chunk(self) -> None:
        self.first_wait = perf_counter() - self.t_call

    def end_chunk(self) -> None:
        self.t_end = perf_counter()
        self.wall_end = time.time()

    def stages(self, replica: dict, t_now: float | None = None) -> dict:
        """The whole breakdown (the replica's `timing` with this ingress's stages added), at the final chunk.

        >>> c = StreamClock({SCOPE_T0: 10.0, SCOPE_WALL0: 1000.0})
        >>> c.t_call, c.first_wait, c.t_end, c.sse_s, c.sse_n = 10.002, 0.004, 10.300, 0.001, 20
        >>> d = c.stages({"replica_ms": 290.0, "to_start_ms": 1.5}, t_now=10.3005)
        >>> d["ingress_parse_ms"], d["handle_ms"], d["sse_tail_ms"], d["ingress_ms"], d["handle_first_ms"]
        (2.0, 8.0, 0.5, 300.5, 2.5)
        """
        t_now = perf_counter() if t_now is None else t_now
        ms = lambda s: round(1000.0 * s, 3)  # noqa: E731
        out = {k: v for k, v in replica.items() if k != "wall"}
        out |= {"ingress_parse_ms": ms(self.t_call - self.t0),
                "handle_ms": round(1000.0 * (self.t_end - self.t_call) - replica.get("replica_ms", 0.0), 3),
                "sse_tail_ms": ms(t_now - self.t_end), "ingress_ms": ms(t_now - self.t0),
                "sse_mean_ms": ms(self.sse_s / self.sse_n) if self.sse_n else 0.0, "sse_chunks": self.sse_n,
                "handle_first_ms": round(1000.0 * self.first_wait - replica.get("to_start_ms", 0.0), 3)}
        out["wall"] = (replica.get("wall") or {}) | {
            "ingress_arrival": self.wall0, "ingress_call": self.wall_call, "ingress_end_recv": self.wall_end,
            "ingress_final": time.time()}
        return out
