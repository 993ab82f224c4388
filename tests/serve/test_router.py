"""The router core in-process (no Ray): admission errors, 429 on a full queue, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from specray.deployments.replica.core import RouterCore, next_chunk
from specray.deployments.replica.errors import ServeError
from specray.deployments.replica.stream_items import StreamEnd
from specray.deployments.replica.request import EngineRequest
from specray.deployments.config import ServeConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def core():
    cfg = ServeConfig.model_validate({"mode": "colocated", "engine": {
        "n_ctx": 1024, "slots": 1, "max_queue": 0, "exact": True, "calibrate": False, "threads": 2}})
    c = RouterCore(cfg)
    yield c
    c.close()
    c.ctx.close()


def test_full_queue_is_429_cancel_frees_the_slot_bad_input_is_400(core):
    async def main():
        long = core.make_request(EngineRequest(prompt="Tell me a long story about a dragon.", max_tokens=500,
                                               ignore_eos=True, chain=()))
        seq, q = await core.submit(long)
        text, term = await next_chunk(q)  # admitted and decoding: the only slot is taken
        assert term is None
        with pytest.raises(ServeError) as e:
            await core.submit(core.make_request(EngineRequest(prompt="hi", max_tokens=4)))
        assert e.value.status == 429
        with pytest.raises(ServeError) as e:
            await core.submit(core.make_request(EngineRequest(prompt="hi", chain=("nope",))))
        assert e.value.status == 400 and "unknown speculator" in str(e.value)
        with pytest.raises(ServeError) as e:
            core.make_request(EngineRequest(messages=[]))
        assert e.value.status == 400
        core.cancel(seq)
        seq2, q2 = await core.submit(core.make_request(EngineRequest(prompt="The capital of France is", max_tokens=4)))
        parts = []
        while True:
            text, term = await next_chunk(q2)
            parts.append(text)
            if term:
                break
        assert type(term) is StreamEnd and term.usage["completion_tokens"] == 4
        assert seq.finish_reason == "cancelled" and len(seq.generated) < 500
        st = core.stats()
        assert st["active"] == 0 and st["queued"] == 0 and st["reserved_cells"] == 0

    asyncio.run(main())
