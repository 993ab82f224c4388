"""Overlapped rounds' bookkeeping on a stand-in target (no model): what waits for the next decode runs inside it
(between the target's launch and collect), in order, and nothing is lost at the end.

The real model's lossless runs are tests/integration/test_overlap.py; served, tests/serve/test_overlap_serve.py."""

from __future__ import annotations

import numpy as np

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest
from specray.engine import scheduler
from specray.engine.scheduler import LEARN_BATCH, Scheduler
from specray.engine.speculators.registry import speculator_factory

from .standin_target import LaunchedTarget, Tok


class RecordingChain(Chain):
    """The real chain (suffix: model-free), its begin and end calls recorded in the target's log."""

    def __init__(self, log: list) -> None:
        super().__init__(ChainConfig(speculators=["suffix"]), speculator_factory())
        self.log = log

    def begin(self, seq_id, names, prompt, grammar=None):
        self.log.append(("begin", seq_id))
        super().begin(seq_id, names, prompt, grammar)

    def end(self, seq_id, names):
        self.log.append(("end", seq_id))
        super().end(seq_id, names)


def _scheduler(log: list) -> Scheduler:
    config = EngineConfig(slots=1, calibrate=False, chain=ChainConfig(speculators=["suffix"]), cache_ram=0,
                          prompt_cache=False)
    s = Scheduler(config, LaunchedTarget(log), Tok(), RecordingChain(log), n_ctx=2048)
    s.use_overlap(decode_blocks=False)  # the launch returns at once, as a GPU's: the work sits between the two
    return s


def test_set_ups_merges_and_events_wait_for_the_next_decode_and_nothing_is_lost():
    log: list = []
    s = _scheduler(log)
    delivered = []
    s.on_event = lambda e: delivered.append((e.seq.id, e.text, e.finished)) or log.append(("event", e.seq.id))
    a = s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=2))
    b = s.submit(GenerationRequest(np.arange(200, 230, dtype=np.int32), max_tokens=1))
    returned = []
    while s.has_work():
        returned += [(e.seq.id, e.text, e.finished) for e in s.step()]
    assert returned == delivered == [(a.id, "x", False), (a.id, "x", True), (b.id, "x", True)]
    # a's set-up runs inside its first decode; its events and its merge inside the next one, where b is set up
    # on the same slot after a's end; b's last event needs no decode to hide behind
    assert log == [
        ("start", 0), ("launch",), ("begin", 0), ("collect",),
        ("launch",), ("event", a.id), ("collect",),
        ("release", 0), ("start", 0), ("launch",), ("end", 0), ("begin", 0), ("event", a.id), ("collect",),
        ("release", 0), ("end", 0), ("event", b.id),
    ]
    assert s.stats.overlapped_rounds == 3 and not s.has_work()


def test_a_cancel_between_rounds_ends_the_speculators_before_the_slot_is_set_up_again():
    log: list = []
    s = _scheduler(log)
    a = s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=50))
    s.step()
    s.step()
    s.cancel(a)  # between rounds: its slot is freed now, its speculators' merge waits for the next decode
    assert log[-1] == ("release", 0) and ("end", 0) not in log
    b = s.submit(GenerationRequest(np.arange(300, 310, dtype=np.int32), max_tokens=1))
    while s.has_work():
        s.step()
    assert log.index(("end", 0)) < len(log) - 1 - log[::-1].index(("begin", 0))  # a's end before b's begin
    assert b.finished and b.generated == [5]


def test_a_rounds_stats_and_prices_are_learnt_inside_the_next_decode():
    log: list = []
    s = _scheduler(log)
    add_round = s.stats.add_round
    s.stats.add_round = lambda *a: log.append(("learn",)) or add_round(*a)
    s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=3))
    while s.has_work():
        s.step()
    rounds = log.count(("launch",))
    assert rounds == 3 and s.stats.rounds == rounds and log.count(("learn",)) == rounds
    # each round's learning comes inside the next round's decode (between its launch and its collect); the last
    # round's, with no decode to hide behind, after it
    at = [i for i, e in enumerate(log) if e == ("learn",)]
    for i in at[:-1]:
        last = max(j for j in range(i) if log[j] in (("launch",), ("collect",)))
        assert log[last] == ("launch",), log
    assert at[-1] > max(i for i, e in enumerate(log) if e == ("collect",))


def test_the_policy_learns_each_verdict_inside_the_next_decode_before_its_slot_is_forgotten():
    log: list = []
    s = _scheduler(log)
    policy = s.policy
    tell, learn, forget = policy.tell, policy.learn, policy.forget_sequence
    policy.tell = lambda prop, *a: log.append(("tell", prop.seq_id)) or tell(prop, *a)
    policy.learn = lambda prop, *a: log.append(("learn", prop.seq_id)) or learn(prop, *a)
    policy.forget_sequence = lambda slot, names: log.append(("forget", slot)) or forget(slot, names)
    a = s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=3))
    b = s.submit(GenerationRequest(np.arange(200, 230, dtype=np.int32), max_tokens=2))
    while s.has_work():
        s.step()
    assert a.finished and b.finished and not s.has_work()
    tells = [i for i, e in enumerate(log) if e[0] == "tell"]
    learns = [i for i, e in enumerate(log) if e[0] == "learn"]
    assert len(tells) == len(learns) == 3  # a's rounds after its prefill (2), b's (1): one verdict each
    for t, l in zip(tells, learns):
        # the speculators hear it in its own round, before the next launch; the policy learns from it inside the
        # next decode (between that launch and its collect) or, with no round left, after the last one
        assert log[t - 1] == ("collect",) and t < l
        opened = max(j for j in range(l) if log[j] in (("launch",), ("collect",)))
        assert log[opened] == ("launch",) or l > max(i for i, e in enumerate(log) if e == ("collect",))
    # slot 0 is forgotten as a is admitted and ends, then as b is admitted and ends: a's verdicts are learnt
    # before its end is forgotten, b's after b's admission and before its end
    forgets = [i for i, e in enumerate(log) if e == ("forget", 0)]
    assert len(forgets) == 4
    assert forgets[0] < learns[0] < learns[1] < forgets[1] < forgets[2] < learns[2] < forgets[3]


def test_without_overlap_the_policy_learns_each_verdict_in_its_own_round():
    log: list = []
    config = EngineConfig(slots=1, calibrate=False, chain=ChainConfig(speculators=["suffix"]), cache_ram=0,
                          prompt_cache=False)
    s = Scheduler(config, LaunchedTarget(log), Tok(), RecordingChain(log), n_ctx=2048)
    accept = s.policy.accept
    s.policy.accept = lambda prop, *a: log.append(("accept", prop.seq_id)) or accept(prop, *a)
    s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=3))
    while s.has_work():
        s.step()
    # each right after its round's decode, before the next one starts
    assert [e for e in log if e[0] in ("launch", "collect", "accept")] == [
        ("launch",), ("collect",), ("launch",), ("collect",), ("accept", 0), ("launch",), ("collect",),
        ("accept", 0)]


def test_without_overlap_rounds_are_learnt_in_batches_in_their_order_and_all_by_the_end(monkeypatch):
    clocks: list = []  # each round's clock as it starts

    class Clock(scheduler.RoundClock):
        def __init__(self, *a):
            super().__init__(*a)
            clocks.append(self)

    monkeypatch.setattr(scheduler, "RoundClock", Clock)
    log: list = []
    config = EngineConfig(slots=1, calibrate=False, chain=ChainConfig(speculators=["suffix"]), cache_ram=0,
                          prompt_cache=False)
    s = Scheduler(config, LaunchedTarget(log), Tok(), RecordingChain(log), n_ctx=2048)
    learnt: list = []  # the clocks of the rounds learnt, as they are
    add_round = s.stats.add_round
    s.stats.add_round = lambda clock, *a: learnt.append(clock) or add_round(clock, *a)
    observed = []
    observe = s.policy.observe
    s.policy.observe = lambda *a: observed.append(a) or observe(*a)
    s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=2 * LEARN_BATCH + 3))
    waiting = []  # after each step: rounds run and not yet learnt
    while s.has_work():
        s.step()
        waiting.append(log.count(("launch",)) - len(learnt))
    rounds = log.count(("launch",))
    assert rounds == 2 * LEARN_BATCH + 3 and s.rounds_run == s.stats.rounds == rounds and len(observed) == rounds
    assert learnt == clocks[:rounds]  # every round's, in order (the last step ran no round)
    # a batch waits until it has LEARN_BATCH rounds, the last one's own included; what is left is learnt once no
    # round runs
    assert waiting[: 2 * LEARN_BATCH] == [*range(1, LEARN_BATCH), 0] * 2
    assert waiting[2 * LEARN_BATCH :] == [1, 2, 3, 0]


def test_a_verdict_the_policy_fails_to_learn_is_logged_and_the_rounds_go_on(caplog):
    log: list = []
    s = _scheduler(log)

    def fail(*a):
        raise RuntimeError("estimates broke")

    s.policy.learn = fail
    a = s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=4))
    while s.has_work():
        s.step()
    assert a.finished and a.generated == [5, 5, 5, 5]
    assert "the policy's learning from a verdict failed" in caplog.text
