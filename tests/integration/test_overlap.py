"""Overlapped rounds (EngineConfig.overlap): a round's text and events are made while the next round decodes.

Lossless and complete on the real model: in exact mode, several sequences at once (queued on fewer slots),
with the default chain, stop strings and a length limit, every sequence's tokens equal target-only decoding
without overlap, and the events a caller gets (step() while has_work()) spell each sequence's text once, in
order, ending with one finished event. Both ways the overlap runs: on a helper thread while this CPU's decode
blocks (the engine's choice here), and after a launch that returns at once (a GPU's way: here the launch
blocks, so nothing is hidden, but the order of the work is the GPU's).
"""

from __future__ import annotations

import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig

from ..conftest import spec_bench_prompts

pytestmark = pytest.mark.model

MAX_TOKENS = 40
CHAIN = ("ngram_mod", "suffix", "ngram_cache")


def _engine(model, overlap: bool, slots: int = 3) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=1024 * slots, exact=True, calibrate=False,
                       overlap=overlap, chain=ChainConfig(speculators=list(CHAIN), n_max=6))
    return LocalEngine(cfg, model=model)


def _requests(engine: LocalEngine, prompts: list[str], chain: tuple[str, ...]):
    reqs = []
    for i, p in enumerate(prompts):
        # every third asks for stop strings (its text then decides where it ends, so it is made at once)
        stop = [". ", "\n\n"] if i % 3 == 1 else None
        reqs.append(engine.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS - 3 * (i % 4),
                                   chain=chain, stop=stop))
    return reqs


def _run_collecting(engine: LocalEngine, reqs) -> tuple[list, dict, list]:
    """Submit all, step while there is work: the sequences, the events each got in order, all events in order."""
    seqs = [engine.submit(r) for r in reqs]
    got: dict[int, list] = {s.id: [] for s in seqs}
    flat = []
    while engine.scheduler.has_work():
        for e in engine.step():
            got[e.seq.id].append(e)
            flat.append(e)
    return seqs, got, flat


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(7)


@pytest.fixture(scope="module")
def baseline(smollm2, prompts):
    eng = _engine(smollm2, overlap=False)
    try:
        seqs = eng.run(_requests(eng, prompts, ()))
        return [(list(s.generated), s.text, s.finish_reason) for s in seqs]
    finally:
        eng.close()


@pytest.mark.parametrize("beside", ["helper thread", "after launch"])
def test_overlapped_rounds_are_lossless_and_deliver_every_event_once_in_order(smollm2, prompts, baseline, beside):
    eng = _engine(smollm2, overlap=True)
    try:
        sched = eng.scheduler
        assert sched.overlap
        if beside == "after launch":
            sched.use_overlap(decode_blocks=False)
        delivered = []
        sched.on_event = delivered.append
        seqs, got, flat = _run_collecting(eng, _requests(eng, prompts, CHAIN))
        assert sched.stats.overlapped_rounds == sched.stats.rounds > 0
        assert sched.stats.overlapped_seconds > 0
        assert sum(s.spec_total.accepted for s in seqs) > 0  # drafts were accepted: the rounds were speculative
        assert {s.finish_reason for s in seqs} == {"stop", "length"}  # both ends, the length limit made later
        for s, (tokens, text, why), req_i in zip(seqs, baseline, range(len(seqs))):
            assert list(s.generated) == tokens, f"prompt {req_i}: tokens differ with overlap ({beside})"
            assert (s.text, s.finish_reason) == (text, why)
            events = got[s.id]
            assert events and events[-1].finished and not any(e.finished for e in events[:-1])
            assert "".join(e.text for e in events) == text
            assert [t for e in events for t in e.tokens] == tokens
        # on_event saw the events step() returned, the same ones in the same order, as they were made
        assert [id(e) for e in delivered] == [id(e) for e in flat]
        assert not sched.has_work()
    finally:
        eng.close()


def test_a_round_that_raises_keeps_the_events_made_during_it(smollm2, prompts):
    """A failed decode (here: the target's collect raising) loses nothing made before it: the events delivered
    while it decoded are returned by the next step."""
    eng = _engine(smollm2, overlap=True, slots=2)
    try:
        sched = eng.scheduler
        seqs = [eng.submit(r) for r in _requests(eng, prompts[:2], CHAIN)]
        events = []
        while sched.stats.rounds < 3:
            events += eng.step()
        pending = sum(1 for s in seqs if not s.finished)
        assert pending  # still running: the last round's events wait for the next round's decode

        runner, collect = eng.runner, eng.runner.collect

        def failing_collect():
            collect()  # the decode completes (the context stays consistent), then the round fails
            raise RuntimeError("injected")

        runner.collect = failing_collect
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        del runner.collect
        for s in seqs:  # what a replica does with a failed round's sequences (Slots.fail)
            sched.cancel(s)
        assert not sched.active and sched.has_work()
        made = eng.step()  # no round to run: the events made while the failed round decoded come back
        assert made and {e.seq.id for e in made} <= {s.id for s in seqs} and not sched.has_work()
        assert sum(len(e.tokens) for e in events + made) == sum(len(s.generated) for s in seqs)
    finally:
        eng.close()


def test_the_overlap_setting_reaches_the_scheduler_and_stays_off_by_default(smollm2):
    eng = _engine(smollm2, overlap=False, slots=1)
    try:
        assert not eng.scheduler.overlap and EngineConfig().overlap is False
        seq = eng.generate("The capital of France is", max_tokens=4, chain=())
        assert len(seq.generated) == 4 and eng.scheduler.stats.overlapped_rounds == 0
    finally:
        eng.close()
