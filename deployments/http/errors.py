"""The one error map: any exception -> OpenAI's error body and HTTP status, for JSON responses and SSE error
events alike.

A ServeError (deployments/replica/errors.py: raised by the request schema, the replica's admission, slots
and faults, or carried by a stream's StreamError) answers as itself; Starlette's HTTP errors keep their
status; a Serve handle that failed because its replica is gone or Serve sheds load is a 503; anything
else is a bug: 500, logged.

>>> from specray.deployments.replica.errors import QueueFull
>>> openai_error(QueueFull("queue full"))
(429, {'error': {'message': 'queue full', 'type': 'rate_limit_error', 'param': None, 'code': 'queue_full'}})
>>> openai_error(type("ActorDiedError", (Exception,), {})("node lost"))[1]["error"]["code"]
'engine_unavailable'
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException

from specray.deployments.http.engine_link import engine_lost
from specray.deployments.replica.errors import EngineFailure, ServeError, Unavailable

log = logging.getLogger("specray.ingress")


def serve_error(e: BaseException) -> ServeError:
    """The ServeError `e` is answered as (see the module docstring)."""
    if isinstance(e, ServeError):
        return e
    if isinstance(e, HTTPException):
        return ServeError(str(e.detail), status=e.status_code)
    name = type(e).__name__
    if name == "BackPressureError":
        return Unavailable(f"server overloaded: {e}", code="overloaded")
    if engine_lost(e):
        return Unavailable(f"engine unavailable: {name}: {e}", code="engine_unavailable")
    log.error("request failed", exc_info=e)
    return EngineFailure(f"internal error: {name}: {e}")


def openai_error(e: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI's {"error": {"message", "type", "param", "code"}}) for any exception."""
    err = serve_error(e)
    return err.status, err.body()
