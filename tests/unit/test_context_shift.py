"""Context shift's pure pieces (no model): the n_keep / n_discard arithmetic, a sequence's shifted views, the
scheduler stage that decides a shift, admission, the draft speculator's cache and the target's KV calls.
The real-model tests are in tests/integration/test_context_shift.py."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import context_shift
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.context_shift import ContextShifter, shift_plan
from specray.engine.request import GenerationRequest, Sequence, SeqState, admission_plan
from specray.engine.rollback import TargetMemory
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.draft import DraftSpeculator, TokenBuffer
from specray.engine.target import StepItem, TargetRunner

from .test_spec_draft import ScriptedBackend


def test_doctests():
    failed, attempted = doctest.testmod(context_shift)
    assert attempted > 0 and failed == 0


def test_shift_plan_frees_room_and_keeps_the_front():
    for n_past in (2, 3, 63, 255, 4095):
        for n_keep in (-1, 0, 5, 300):
            for n_discard in (None, 1, 16, 10_000):
                keep, discard = shift_plan(n_past, n_keep, n_discard, n_prompt=min(40, n_past), bos=1)
                assert 0 <= keep < n_past and 1 <= discard <= n_past - keep


def seq_with(history: list[int], n_prompt: int, **req) -> Sequence:
    r = GenerationRequest(np.asarray(history[:n_prompt], dtype=np.int32), max_tokens=1000, **req)
    s = Sequence(r, (), 0, 0)
    s.append_tokens(np.asarray(history[n_prompt:], dtype=np.int32))
    s.state = SeqState.DECODING
    s.n_past = len(history) - 1  # the last token is not decoded yet
    return s


def test_sequence_views_after_shifts():
    s = seq_with(list(range(100, 120)), n_prompt=5)  # 19 cells, last token 119
    s.shift(2, 6)  # cells [2, 8) go
    assert s.n_past == 13 and s.take_shift() == (2, 6) and s.take_shift() is None
    assert s.kv_history().tolist() == [100, 101] + list(range(108, 120))
    assert len(s.history_view()) == 20  # the whole history stays (n-gram speculators, output)
    s.append_tokens(np.array([120, 121], dtype=np.int32))
    s.n_past += 2
    s.shift(2, 3)  # later shifts discard right after the same front
    assert s.kv_history().tolist() == [100, 101] + list(range(111, 122)) and s.n_past == 12
    assert s.kv_prefix().tolist() == [100, 101]  # only the front's cells are a clean prefix
    fresh = seq_with(list(range(10)), n_prompt=5)
    assert fresh.kv_prefix().tolist() == list(range(9)) and fresh.kv_history() is not None


def test_admission_plan_lets_a_shifting_request_past_the_context():
    req = GenerationRequest(np.arange(10, dtype=np.int32), max_tokens=500)
    with pytest.raises(ValueError, match="exceeds the context"):
        admission_plan(req, ChainConfig(n_max=8), 64)
    assert admission_plan(req, ChainConfig(n_max=8), 64, shift=True)[2] == 64  # reserves at most the context
    with pytest.raises(ValueError, match="does not fit"):  # the prompt itself must still fit
        admission_plan(GenerationRequest(np.arange(64, dtype=np.int32)), ChainConfig(), 64, shift=True)


class FakeChain:
    def __init__(self, spec) -> None:
        self.instances = {"draft": spec}


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail, self.ended = [], fail, []

    def shift(self, seq_id, keep, discard):
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append((seq_id, keep, discard))

    def end(self, seq_id):
        self.ended.append(seq_id)


def test_shifter_decides_like_llama_server():
    shifter = ContextShifter(EngineConfig(context_shift=True), TargetMemory(), n_ctx=64, bos=1)
    s = seq_with([1] + list(range(10, 73)), n_prompt=5, )  # 64 tokens: 63 cells, n_past + 1 == n_ctx
    s.slot, s.chain = 0, ("draft",)
    short = seq_with([1] + list(range(10, 40)), n_prompt=5)
    rec = Recorder()
    assert shifter.apply([s, short], FakeChain(rec)) == 1
    assert (s.shift_keep, s.shifted, s.n_past) == (1, 31, 32)  # BOS kept, (63 - 1) // 2 discarded
    assert rec.calls == [(0, 1, 31)] and s.pending_shift == (1, 31)
    # a request may opt out, or set its own n_keep / n_discard
    off = seq_with([1] + list(range(10, 73)), n_prompt=5, context_shift=False)
    assert shifter.plan(off) is None
    own = seq_with([1] + list(range(10, 73)), n_prompt=5, n_keep=-1, n_discard=8)
    assert shifter.plan(own) == (5, 8)
    # a speculator that fails to shift is ended for the sequence (it would draft from a cache out of line)
    bad = Recorder(fail=True)
    s2 = seq_with([1] + list(range(10, 73)), n_prompt=5)
    s2.slot, s2.chain = 3, ("draft",)
    shifter.apply([s2], FakeChain(bad))
    assert bad.ended == [3]


def test_shifting_is_refused_where_the_target_cannot():
    recurrent = TargetMemory(kind="recurrent", rollback="checkpoint", can_shift=False)
    with pytest.raises(ValueError, match="context_shift"):
        ContextShifter(EngineConfig(context_shift=True), recurrent, n_ctx=64)
    shifter = ContextShifter(EngineConfig(), recurrent, n_ctx=64)  # off by default: fine
    assert not shifter.enabled(GenerationRequest(np.arange(3, dtype=np.int32)))
    with pytest.raises(ValueError, match="context_shift"):
        shifter.enabled(GenerationRequest(np.arange(3, dtype=np.int32), context_shift=True))


def test_tokens_delete():
    t = TokenBuffer()
    t.extend(np.arange(10))
    t.delete(2, 5)
    assert t.view().tolist() == [0, 1, 5, 6, 7, 8, 9]
    t.delete(6, 100)
    assert t.view().tolist() == [0, 1, 5, 6, 7, 8]


class ShiftingBackend(ScriptedBackend):
    def __init__(self, script, can=True):
        super().__init__(script)
        self.can, self.shifts = can, []

    def shift(self, seq_id, keep, discard):
        if not self.can:
            return False
        kv = self.kv.setdefault(seq_id, [])
        del kv[keep : keep + discard]
        self.shifts.append((seq_id, keep, discard))
        return True


@pytest.mark.parametrize("can", [True, False])
def test_draft_speculator_follows_the_shift(can):
    script = list(range(10, 60))
    backend = ShiftingBackend(script, can=can)
    spec = DraftSpeculator(None, backend)
    spec.begin(0, np.array(script[:5], dtype=np.int32))
    spec.process(0, np.array(script[:30], dtype=np.int32), 0)
    spec.draft([DraftRequest(0, np.array(script[:31], dtype=np.int32), 3)])
    spec.process(0, np.array([script[30]], dtype=np.int32), 30)  # the draft rejected: cells past 31 go
    spec.shift(0, 2, 10)
    shifted = script[:2] + script[12:31]
    assert spec.committed(0).tolist() == shifted
    kv = spec.kv_tokens(0).tolist()
    assert kv == shifted[: len(kv)] and backend.kv[0] == kv  # the speculator's view is the backend's cache
    assert len(kv) > 2 if can else kv == []  # shifted in place, or reset (caught up on the next draft)
    # the next draft catches up on the shifted tokens (the scripted model is off-script now: any draft)
    spec.draft([DraftRequest(0, np.array(shifted + [script[31]], dtype=np.int32), 3)])
    assert backend.kv[0][: len(shifted) + 1] == shifted + [script[31]]
    assert spec.counters.unsynced == 0 and spec.counters.failures == 0


class FakeCtx:
    n_batch = 64

    def __init__(self, can: bool) -> None:
        self.can, self.shifts = can, []

    def shift_seq(self, seq_id, keep, discard):
        self.shifts.append((seq_id, keep, discard))
        return self.can


def test_target_applies_shifts_before_decoding_or_fails_the_sequence():
    ctx = FakeCtx(can=False)
    runner = TargetRunner.__new__(TargetRunner)
    runner.ctx = ctx
    results = {}
    items = [StepItem(0, np.array([5], dtype=np.int32), 32, shift=(1, 31)), StepItem(1, np.array([6], np.int32), 9)]
    kept = runner._shift(items, results)
    assert [it.seq_id for it in kept] == [1] and results[0].error and "context_shift" in results[0].error
    ctx.can = True
    assert runner._shift(items, {}) == items and ctx.shifts[-1] == (0, 1, 31)


class RecordingClient:
    """CompanionClient stand-in: records each call (method, payload), answers with no drafts."""

    epoch = 1

    def __init__(self):
        self.calls = []

    def call(self, method, payload, default=None):
        self.calls.append((method, payload))
        return {"drafts": [np.zeros(0, np.int32) for _ in payload["requests"]], "unsynced": [], "inside_s": 0.0,
                "step_costs": {1: 0.001}, "acks": []}


def test_companion_proxies_send_the_shift_in_order():
    from specray.deployments.actors.companion import CompanionDraftProxy
    from specray.deployments.actors.companion_hidden import CompanionHiddenProxy
    from specray.engine.speculators.mtp import MtpParams

    client = RecordingClient()
    draft = CompanionDraftProxy(None, client)
    draft.begin(0, np.array([1, 2], np.int32))
    draft.process(0, np.array([1, 2, 3], np.int32), 0)
    draft.shift(0, 1, 1)  # the commits at the old positions go first, in a call of their own
    assert len(client.calls) == 1 and client.calls[0][1]["commits"][0][1] == 0 and client.calls[0][1]["shifts"] == []
    draft.process(0, np.array([4], np.int32), 2)
    draft.draft([DraftRequest(0, np.array([1, 3, 4, 5], np.int32), 3)])
    sent = client.calls[1][1]
    assert sent["shifts"] == [(0, 1, 1)] and sent["commits"][0][1] == 2  # the companion shifts, then commits
    hidden = CompanionHiddenProxy("mtp", MtpParams(), RecordingClient())
    hidden.begin(0, np.array([1], np.int32))
    hidden.shift(0, 1, 4)
    assert [e[0] for e in hidden._events] == ["begin", "shift"]
