"""A chain change on a running router (what an arm's user_config does, through RouterCore.set_chain) while a
request is decoding: the request goes on with the rebuilt speculators, its text is still the plain-decoding
text, counters carry over, a speculator added at run time drafts for the requests that follow, and a bad
change is refused without touching the running chain. In-process router, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from specray.deployments.config import ServeConfig
from specray.deployments.replica.core import RouterCore, next_chunk
from specray.deployments.replica.request import EngineRequest, replace
from specray.engine.config import ChainConfig

from .conftest import SPEC_PARAMS

pytestmark = pytest.mark.model

PROMPT = "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,"


@pytest.fixture(scope="module")
def core():
    cfg = ServeConfig.model_validate({"mode": "colocated", "engine": {
        "n_ctx": 1024, "slots": 2, "exact": True, "calibrate": False, "threads": 2,
        "chain": {"speculators": ["ngram_mod", "suffix"], "params": SPEC_PARAMS, "policy": "first", "n_max": 8}}})
    c = RouterCore(cfg)
    yield c
    c.close()
    c.ctx.close()


async def _collect(core, queue, on_first=None) -> tuple[str, dict]:
    parts, first = [], True
    while True:
        text, term = await next_chunk(queue)
        parts.append(text)
        if first and on_first is not None:
            first = False
            on_first()
        if term:
            return "".join(parts), term


def test_chain_change_mid_request_keeps_the_text_and_counters(core):
    req = EngineRequest(prompt=PROMPT, max_tokens=48, ignore_eos=True)

    async def main():
        seq, q = await core.submit(core.make_request(replace(req, chain=())))  # plain decoding: the reference
        plain, _ = await _collect(core, q)
        seq, q = await core.submit(core.make_request(req))
        old = core.chain.instances["ngram_mod"]
        new = core.chain.config.model_copy(update={"params": SPEC_PARAMS | {"ngram_mod": SPEC_PARAMS["ngram_mod"]
                                                                               | {"n_max": 3}}})
        results = []
        text, term = await _collect(core, q, on_first=lambda: results.append(core.set_chain(new)))
        return plain, text, term, old, results[0]

    plain, text, term, old, result = asyncio.run(main())
    assert text == plain  # lossless across the swap
    assert result["rebuilt"] == ["ngram_mod"] and result["added"] == [] and result["resumed_sequences"] == 1
    assert core.chain.config.params["ngram_mod"]["n_max"] == 3
    assert core.cfg.engine.chain.params["ngram_mod"]["n_max"] == 3  # admission (draft room) sees it too
    rebuilt = core.chain.instances["ngram_mod"]
    assert rebuilt is not old and rebuilt.stats is old.stats  # a new instance; its counters carried over
    assert term.speculative["drafts"] > 0

    # the rebuilt instance honours the new parameter: ngram_mod drafts no more than 3 tokens from now on
    def drafted_per_pos():
        return list(core.stats()["speculators"]["ngram_mod"]["drafted_per_pos"]) + [0] * 16

    pos0 = drafted_per_pos()

    async def again():
        _, q = await core.submit(core.make_request(replace(req, chain=("ngram_mod",))))
        return await _collect(core, q)

    text2, term2 = asyncio.run(again())
    grown = [b - a for a, b in zip(pos0, drafted_per_pos())]
    assert text2 == plain and term2.speculative["drafts"] > 0
    assert grown[0] > 0 and not any(grown[3:]), grown

    n_max_before = core.chain.instances["ngram_mod"]
    with pytest.raises(ValueError, match="warp"):
        core.set_chain(ChainConfig(speculators=["ngram_mod", "warp"]))
    assert core.chain.instances["ngram_mod"] is n_max_before and core.chain.config.params["ngram_mod"]["n_max"] == 3
    assert core.cfg.engine.chain.params["ngram_mod"]["n_max"] == 3


@pytest.fixture(scope="module")
def core_ngram_mod():
    """A router whose chain is ngram_mod alone: suffix has never been built in it."""
    cfg = ServeConfig.model_validate({"mode": "colocated", "engine": {
        "n_ctx": 1024, "slots": 2, "exact": True, "calibrate": False, "threads": 2,
        "chain": {"speculators": ["ngram_mod"], "params": SPEC_PARAMS, "policy": "first", "n_max": 8}}})
    c = RouterCore(cfg)
    yield c
    c.close()
    c.ctx.close()


def test_a_speculator_added_at_run_time_drafts_and_is_accepted(core_ngram_mod):
    """The issue: adding suffix to a running ngram_mod chain left it without its estimate state, so its first
    draft raised in every round, the scheduler swallowed it and suffix (and every draft with it) was lost."""
    core = core_ngram_mod
    req = EngineRequest(prompt=PROMPT, max_tokens=48, ignore_eos=True)
    # suffix first: under the `first` policy it is asked every round, so every round would hit the failure
    new = core.chain.config.model_copy(update={"speculators": ["suffix", "ngram_mod"]})

    async def main():
        _, q = await core.submit(core.make_request(req))  # running when the change lands: keeps ngram_mod
        results = []
        _, term = await _collect(core, q, on_first=lambda: results.append(core.set_chain(new)))
        _, q = await core.submit(core.make_request(req))  # admitted after it: the new chain
        _, term2 = await _collect(core, q)
        return results[0], term, term2

    result, term, term2 = asyncio.run(main())
    assert result == {"chain": "suffix,ngram_mod", "rebuilt": [], "added": ["suffix"], "resumed_sequences": 0}
    assert set(term.speculative["by_speculator"]) <= {"ngram_mod"}
    st = core.stats()
    assert st["chain"] == "suffix,ngram_mod" and core.cfg.engine.chain.speculators == ["suffix", "ngram_mod"]
    assert st["scheduler"]["speculator_failures"] == 0 and st["disabled_speculators"] == []
    suffix = st["speculators"]["suffix"]
    assert suffix["drafts_chosen"] > 0 and suffix["tokens_accepted"] > 0, suffix
    assert term2.speculative["by_speculator"]["suffix"]["accepted_tokens"] == suffix["tokens_accepted"]
