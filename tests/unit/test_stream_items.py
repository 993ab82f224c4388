"""The replica's stream items and the one error map: every item type survives pickling (they cross Serve
handles), and every error class answers with the same status and OpenAI body as JSON and as an SSE event."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from specray.deployments.http.errors import openai_error
from specray.deployments.http.sse import sse_body
from specray.deployments.http.timing import StreamClock
from specray.deployments.replica import errors
from specray.deployments.replica.errors import (BadRequest, ClientGone, EngineFailure, NotFound, QueueFull, ServeError,
                                                Unavailable)
from specray.deployments.replica.stream_items import StreamDelta, StreamEnd, StreamError, StreamStart, merge

ERRORS = [  # (error, status, type, code) as the tests of the served API expect them
    (BadRequest("prompt is empty", param="prompt"), 400, "invalid_request_error", None),
    (BadRequest("bad grammar", param="grammar", code="invalid_grammar"), 400, "invalid_request_error",
     "invalid_grammar"),
    (NotFound("no such route"), 404, "not_found_error", None),
    (QueueFull("the queue is full"), 429, "rate_limit_error", "queue_full"),
    (Unavailable("the target model is restarting", code="target_unavailable"), 503, "server_error",
     "target_unavailable"),
    (EngineFailure("internal error: boom"), 500, "server_error", None),
    (EngineFailure("state lost", code="target_state_error"), 500, "server_error", "target_state_error"),
    (ClientGone("the client closed the connection"), 499, "invalid_request_error", "client_disconnected"),
    (ServeError("missing API key", code="invalid_api_key", status=401), 401, "invalid_request_error",
     "invalid_api_key"),
]
ITEMS = [StreamStart(3, 6, 1), StreamDelta(" Paris", 1.5),
         StreamDelta("x", 2.0, logprobs=[{"id": 1, "token": "x", "bytes": [120], "logprob": -0.1, "top": []}]),
         StreamEnd("stop", {"prompt_tokens": 6}, {"drafts": 2}, {"ttft_s": 0.1})] + [StreamError(e) for e, *_ in ERRORS]


def test_doctests():
    import doctest

    from specray.deployments.http import errors as http_errors
    from specray.deployments.replica import sinks, stream_items

    for module in (errors, http_errors, sinks, stream_items):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


@pytest.mark.parametrize("item", ITEMS, ids=lambda i: type(i).__name__)
def test_every_item_survives_pickling(item):
    back = pickle.loads(pickle.dumps(item))
    if type(item) is StreamError:
        e, b = item.error, back.error
        assert (type(b), str(b), b.status, b.param, b.code, b.body()) == (type(e), str(e), e.status, e.param, e.code,
                                                                          e.body())
    else:
        assert back == item


def test_deltas_merge_and_say_nothing_when_empty():
    lp = {"id": 1, "token": "a", "bytes": [97], "logprob": -1.0, "top": []}
    assert merge([StreamDelta("a", 1.0, logprobs=[lp]), StreamDelta("b", 2.0, logprobs=[])]) == \
        StreamDelta("ab", 1.0, [lp], None)
    assert merge([StreamDelta("a", 1.0, logprobs=[])]) == StreamDelta("a", 1.0)  # no entries: plain
    assert merge([StreamDelta("", 1.0, logprobs=[])]) is None


@pytest.mark.parametrize("error, status, kind, code", ERRORS, ids=lambda x: getattr(x, "message", None))
def test_one_error_map_for_json_and_sse(error, status, kind, code):
    body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}
    assert openai_error(error) == (status, body)
    from specray.deployments.http.ingress import _error_response

    response = _error_response(error)
    assert (response.status_code, json.loads(response.body)) == (status, body)
    assert ("retry-after" in response.headers) == (status in (429, 503))
    assert sse_events(StreamError(error)) == [body, "[DONE]"]


def test_what_is_not_a_serve_error_maps_too():
    lost = type("ActorDiedError", (Exception,), {})("node lost")
    shed = type("BackPressureError", (Exception,), {})("full")
    assert openai_error(lost)[0] == 503 and openai_error(lost)[1]["error"]["code"] == "engine_unavailable"
    assert openai_error(shed)[1]["error"] == {"message": "server overloaded: full", "type": "server_error",
                                              "param": None, "code": "overloaded"}
    assert openai_error(KeyError("x")) == (500, {"error": {"message": "internal error: KeyError: 'x'",
                                                           "type": "server_error", "param": None, "code": None}})


class Records:
    def __init__(self) -> None:
        self.errors: list[int] = []

    def add_error(self, status: int) -> None:
        self.errors.append(status)


def sse_events(*items) -> list:
    """The SSE body's events for a stream of these items (after its start), as JSON (or the [DONE] marker)."""
    class Gen:
        def __init__(self):
            self.it = iter(items)

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                return next(self.it)
            except StopIteration:
                raise StopAsyncIteration from None

        def cancel(self):
            pass

    async def main():
        body = sse_body(Gen(), "cmpl-1", "m", Records(), False, False, "default", StreamClock({}))
        return [line async for line in body]

    out = []
    for line in asyncio.run(main()):
        data = line.removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
