"""ASGI middleware in front of every ingress route: API key, body size, UTF-8.

It runs before FastAPI parses anything, so a request without the right key
(401), with a body over the limit (413) or a body that is not UTF-8 (400)
costs neither JSON parsing nor model work. `/health` needs no key (load
balancers and Serve's probes call it). Errors use OpenAI's body.

The settings come from the deployment's ServeConfig: `IngressRoutes.__init__`
(the Ingress, or the fused engine replica) calls `configure` (one ingress
replica per process, so a module-level setting is the replica's own).
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from time import perf_counter

from specray.deployments.http.errors import openai_error
from specray.deployments.http.timing import SCOPE_T0, SCOPE_WALL0
from specray.deployments.replica.errors import ServeError


@dataclass
class GuardSettings:
    api_key: str | None = None
    max_body_bytes: int = 2 << 20


_settings = GuardSettings()

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
OPEN_PATHS = frozenset({"/health"})


def configure(api_key: str | None, max_body_bytes: int) -> None:
    global _settings
    _settings = GuardSettings(api_key or None, max_body_bytes)


def relative_path(scope: dict) -> str:
    """The route path without the app's route prefix (Serve passes it as root_path)."""
    path = scope.get("path", "/")
    root = scope.get("root_path", "") or ""
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


def _header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


def check_key(scope: dict, key: str) -> str | None:
    """None if the request carries the key, else the reason it is refused."""
    raw = _header(scope, b"authorization")
    if raw is None:
        return "missing API key: send the header `Authorization: Bearer <key>`"
    scheme, _, token = raw.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "malformed Authorization header: expected `Bearer <key>`"
    if not hmac.compare_digest(token.strip().encode("utf-8", "replace"), key.encode("utf-8")):
        return "invalid API key"
    return None


async def send_error(send, status: int, message: str, code: str | None = None, param: str | None = None,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    _, err = openai_error(ServeError(message, param=param, code=code, status=status))
    body = json.dumps(err).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # arrival, for the per-stage timing (timing.py): ingress_parse starts here, before the body is read
        scope[SCOPE_T0], scope[SCOPE_WALL0] = perf_counter(), time.time()
        s = _settings
        if s.api_key and relative_path(scope) not in OPEN_PATHS:
            why = check_key(scope, s.api_key)
            if why is not None:
                return await send_error(send, 401, why, code="invalid_api_key",
                                        headers=[(b"www-authenticate", b"Bearer")])
        if scope.get("method") not in BODY_METHODS:
            return await self.app(scope, receive, send)

        limit = s.max_body_bytes
        too_big = f"request body too large: the limit is {limit} bytes"
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await send_error(send, 400, "invalid Content-Length header")
            if n > limit:
                return await send_error(send, 413, too_big, code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                return await send_error(send, 413, too_big, code="request_too_large")
            chunks.append(part)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await send_error(send, 400, f"request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at "
                                    f"offset {e.start})", code="invalid_encoding")

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as usual

        await self.app(scope, replay, send)
