"""The errors a request can end in, typed: each carries its HTTP status, OpenAI error type and code.

The replica raises them (admission, slots, faults) and puts them in a stream's `StreamError`; the ingress
turns any exception into OpenAI's body and status with one function (deployments/http/errors.py). They
cross Serve handles pickled (an Exception's args plus its attributes).

>>> e = QueueFull("the queue is full (8 waiting)")
>>> e.status, e.code, e.type, str(e)
(429, 'queue_full', 'rate_limit_error', 'the queue is full (8 waiting)')
>>> BadRequest("prompt is empty", param="prompt").body()
{'error': {'message': 'prompt is empty', 'type': 'invalid_request_error', 'param': 'prompt', 'code': None}}
"""

from __future__ import annotations


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (what OpenAI's clients map it back to).

    >>> [error_type(s) for s in (400, 404, 429, 503)]
    ['invalid_request_error', 'not_found_error', 'rate_limit_error', 'server_error']
    """
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ServeError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with `status`. A subclass
    fixes the status (and a default code); `status=` here sets it for an HTTP-layer error (401, 413, ...)."""

    status = 500
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else type(self).code
        self.status = status if status is not None else type(self).status

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ServeError):
    """Input the server cannot take (a bad field, a prompt that does not fit): 400."""

    status = 400


class NotFound(ServeError):
    status = 404


class QueueFull(ServeError):
    """The replica's queue is full: 429, answered with Retry-After."""

    status = 429
    code = "queue_full"


class Unavailable(ServeError):
    """Nothing can serve the request now (the target restarting or lost, the engine replica gone, Serve
    shedding load): 503, answered with Retry-After."""

    status = 503


class EngineFailure(ServeError):
    """A bug or a state the engine could not go on from: 500."""

    status = 500


class ClientGone(ServeError):
    """The client closed its connection mid-stream (nobody reads the answer; not counted as an error)."""

    status = 499
    code = "client_disconnected"
