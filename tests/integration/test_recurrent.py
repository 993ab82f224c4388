"""Speculation on recurrent and hybrid targets: a rejected draft never stays in the state.

Two synthetic targets with SmolLM2's vocabulary (native/synthetic_gguf.py): a pure Mamba-2 (llama.cpp cannot
roll its state back: checkpoint mode saves, restores and replays) and an LFM2 hybrid (short convolutions plus
attention; llama.cpp keeps rollback snapshots for it, and checkpoint mode works too). Their output layers make
greedy text settle into short loops after a wandering start, so n-gram drafts hit, miss, and hit in part.
Every speculator and the default chain must give the target-only output token for token, with 1 and 4 slots,
and the counters must show partial rejections, i.e. that the rollback path really ran.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.sampling import SamplingParams
from specray.native.model import Model
from specray.native.synthetic_gguf import write_hybrid_target, write_recurrent_target

from ..conftest import spec_bench_prompts
# every model-free speculator, with parameters that draft while the text still wanders (many partial rejections)
from .test_lossless import ALL, PARAMS

DEFAULT_CHAIN = tuple(ChainConfig().speculators)
MAX_TOKENS = 48
PROMPTS = ["one two three one two three one two three one two",
           "red green blue red green blue red green",
           "def f(x): return x\ndef g(x): return x\ndef h(x):"] + spec_bench_prompts(3)
# (model, rollback requested, rollback run, slots)
# (snapshots: at most rollback.MAX_SNAPSHOT_SLOTS slots)
CASES = [("mamba2", "auto", "checkpoint", 1), ("mamba2", "auto", "checkpoint", 4),
         ("lfm2", "snapshots", "snapshots", 1), ("lfm2", "snapshots", "snapshots", 2), ("lfm2", "auto", "checkpoint", 4),
         ("lfm2", "checkpoint", "checkpoint", 2)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("recurrent")
    out = {"mamba2": Model(write_recurrent_target(str(d / "mamba2.gguf"))),
           "lfm2": Model(write_hybrid_target(str(d / "lfm2.gguf")))}
    yield out
    for m in out.values():
        m.close()


def _engine(model, rollback: str, slots: int, speculators=ALL, **kw) -> LocalEngine:
    # the engine's own chain names speculators, so a rollback-snapshot context is asked for (builder.open_target)
    cfg = EngineConfig(model=model.path, slots=slots, n_ctx=512 * slots, calibrate=False, rollback=rollback,
                       chain=ChainConfig(speculators=list(speculators), params=PARAMS, policy="first", n_max=8), **kw)
    return LocalEngine(cfg, model=model)


def _run(engine: LocalEngine, chain: tuple[str, ...], sampling: SamplingParams | None = None):
    reqs = [engine.request(p, max_tokens=MAX_TOKENS, chain=chain, ignore_eos=True,
                           **({"sampling": sampling} if sampling else {})) for p in PROMPTS]
    return engine.run(reqs)


@pytest.mark.parametrize("name,requested,mode,slots", CASES, ids=lambda v: str(v))
def test_speculation_on_a_recurrent_target_is_token_identical(models, name, requested, mode, slots):
    eng = _engine(models[name], requested, slots)
    try:
        assert eng.scheduler.memory.kind == ("recurrent" if name == "mamba2" else "hybrid")
        assert eng.scheduler.memory.rollback == mode
        assert not eng.scheduler.prefix_cache.idle.enabled  # a recurrent state cannot be cut back to a prefix
        base = [s.generated for s in _run(eng, ())]
        assert all(len(b) == MAX_TOKENS for b in base)
        for chain in [(n,) for n in ALL] + [DEFAULT_CHAIN]:
            seqs = _run(eng, chain)
            for i, s in enumerate(seqs):
                assert s.error is None
                assert s.generated == base[i], f"prompt {i} diverged under {chain} ({name}, {mode}, {slots} slots)"
        rb = eng.scheduler.stats.rollback
        # partial rejections happened, and were taken back the way the mode says
        assert rb.rollbacks > 0 and rb.verifies > rb.rollbacks
        if mode == "checkpoint":
            assert rb.saves >= rb.verifies and rb.restores == rb.rollbacks and rb.replay_rows >= rb.restores
            assert rb.state_bytes > 0
        else:
            assert rb.saves == rb.restores == rb.replay_rows == 0
        if slots > 1:
            assert eng.runner.max_seqs_in_decode >= 2
        assert eng.scheduler.stats.failed_sequences == 0
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["mamba2", "lfm2"])
def test_seeded_sampling_with_penalties_is_the_target_only_output(models, name):
    """Sampled decoding: each position's draw depends on (seed, position, logits) and the penalty window holds
    only committed tokens, so a seeded request gives the target-only tokens whatever was drafted, rolled back
    and replayed (a replay pushed into the window twice would change the penalised draws)."""
    eng = _engine(models[name], "checkpoint", 4)
    try:
        sp = SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, repeat_last_n=16, seed=7)
        base = [s.generated for s in _run(eng, (), sp)]
        got = [s.generated for s in _run(eng, ("ngram_simple", "suffix"), sp)]
        assert got == base
        assert eng.scheduler.stats.rollback.restores > 0
    finally:
        eng.close()


def test_plain_decoding_runs_without_snapshots(models):
    """Without speculation the context asks for no snapshots: every decode would write them for nothing."""
    eng = _engine(models["lfm2"], "snapshots", 1, speculators=())
    try:
        assert eng.ctx.n_rs_seq == 0
        assert eng.scheduler.memory.rollback == "checkpoint"  # still correct for a request that asks for drafts
    finally:
        eng.close()


def test_snapshots_refused_where_the_architecture_has_none_or_with_many_slots(models):
    with pytest.raises(ValueError, match="architecture does not have"):
        _engine(models["mamba2"], "snapshots", 1)
    with pytest.raises(ValueError, match="at most 2 slots"):
        _engine(models["lfm2"], "snapshots", 4)


@pytest.mark.parametrize("name", ["mamba2", "lfm2"])
def test_context_shift_is_refused_where_positions_cannot_shift(models, name):
    with pytest.raises(ValueError, match="context_shift"):
        _engine(models[name], "checkpoint", 1, context_shift=True)
    eng = _engine(models[name], "checkpoint", 1)  # off by default: fine, and a request cannot ask for it
    req = eng.request(PROMPTS[0], max_tokens=4)
    req.context_shift = True
    with pytest.raises(ValueError, match="context_shift"):
        eng.submit(req)
    eng.close()


def test_rollback_off_decodes_without_drafts(models):
    eng = _engine(models["lfm2"], "off", 2)
    try:
        seqs = _run(eng, ALL)
        assert sum(s.spec_total.drafted for s in seqs) == 0
        assert all(len(s.generated) == MAX_TOKENS for s in seqs)
    finally:
        eng.close()


@pytest.mark.parametrize("name,mode", [("lfm2", "snapshots"), ("mamba2", "checkpoint"), ("lfm2", "checkpoint")])
def test_a_refused_rollback_fails_that_request_only(models, name, mode, monkeypatch):
    """The target refuses the rollback once (seq_rm false in snapshots mode, a failing restore in checkpoint
    mode): that sequence ends with an error naming it, the others in its batch and the next request are
    exactly the target-only output."""
    eng = _engine(models[name], mode, 2 if mode == "snapshots" else 4)
    try:
        base = [s.generated for s in _run(eng, ())]
        refused = []
        if mode == "snapshots":
            real = eng.ctx.seq_rm

            def seq_rm(seq_id, p0=-1, p1=-1):
                if p0 > 0 and not refused:  # the first partial removal: a rollback
                    refused.append(seq_id)
                    return False
                return real(seq_id, p0, p1)

            monkeypatch.setattr(eng.ctx, "seq_rm", seq_rm)
        else:
            cps = eng.runner.rollback.checkpoints
            real = cps.restore

            def restore(seq_id):
                if not refused:
                    refused.append(seq_id)
                    raise RuntimeError("llama.cpp failed to restore the recurrent state (injected)")
                real(seq_id)

            monkeypatch.setattr(cps, "restore", restore)
        seqs = _run(eng, ("ngram_simple",))
        failed = [i for i, s in enumerate(seqs) if s.error is not None]
        assert len(failed) == 1 and len(refused) == 1
        bad = seqs[failed[0]]
        assert bad.finish_reason == "error" and bad.slot == refused[0]
        assert ("refused to drop" if mode == "snapshots" else "restoring its recurrent state failed") in bad.error
        assert base[failed[0]][: len(bad.generated)] == bad.generated  # what it emitted before was right
        for i, s in enumerate(seqs):
            if i not in failed:
                assert s.generated == base[i]
        assert eng.scheduler.stats.failed_sequences == 1
        # the slot was cleared: the next requests, on every slot, are right again
        assert [s.generated for s in _run(eng, ("ngram_simple",))] == base
    finally:
        eng.close()


def test_checkpoint_buffers_are_reused(models):
    eng = _engine(models["mamba2"], "auto", 2)
    try:
        _run(eng, ("ngram_simple",))
        cps = eng.runner.rollback.checkpoints
        held = cps.nbytes
        assert held > 0 and held <= 2 * eng.scheduler.stats.rollback.state_bytes  # one buffer per slot
        _run(eng, ("ngram_simple",))
        assert cps.nbytes == held
    finally:
        eng.close()


def test_calibration_runs_on_a_recurrent_target(models):
    """Calibration cuts its slot back after every timed decode; a recurrent state cannot be cut, so it is
    cleared and prefilled again: the table comes out, and the engine still decodes right afterwards."""
    eng = _engine(models["mamba2"], "auto", 1)
    try:
        table = eng.runner.measure_decode_costs(sizes=(1, 4, 8), reps=2)
        assert sorted(table) == [1, 4, 8] and all(v > 0 for v in table.values())
        out = eng.generate(PROMPTS[0], max_tokens=8, chain=("ngram_simple",), ignore_eos=True)
        ref = _engine(models["mamba2"], "auto", 1)
        try:
            assert ref.generate(PROMPTS[0], max_tokens=8, chain=(), ignore_eos=True).generated == out.generated
        finally:
            ref.close()
    finally:
        eng.close()


def test_hidden_rows_skip_replayed_tokens():
    """A replayed prefix is decoded again but was already emitted: the penalty window and the hidden-row
    hand-off see each committed token once (TargetRunner.step with a fake context)."""
    from specray.engine.rollback import StateRollback
    from specray.engine.target import StepItem, TargetRunner

    class Batch:
        def __init__(self):
            self.rows = []

        def clear(self):
            self.rows = []

        def add_seq(self, seq, toks, pos0, n_logits):
            self.rows += [(seq, int(t), pos0 + i, i >= len(toks) - n_logits) for i, t in enumerate(toks)]

        @property
        def n_tokens(self):
            return len(self.rows)

    class Ctx:
        n_batch, n_ctx_seq = 64, 512

        def __init__(self):
            self.batch, self.decoded = Batch(), []

        def decode(self, batch):
            self.decoded.append(list(batch.rows))
            out = [r for r in batch.rows if r[3]]
            logits = np.zeros((len(out), 16), dtype=np.float32)
            for i in range(len(out)):
                logits[i, 5] = 1.0  # the target always says token 5
            return logits

        def seq_rm(self, *a):
            return True

        def clear_seq(self, seq):
            pass

        def recycled_bytes(self):  # no host-tier saves here
            return 0

    class Cps:
        def save(self, seq):
            return 8

        def restore(self, seq):
            pass

        def drop(self, seq):
            pass

    ctx = Ctx()
    runner = TargetRunner(ctx, rollback=StateRollback("checkpoint", Cps()))
    runner.start(0, SamplingParams(repeat_penalty=1.1, repeat_last_n=64), np.array([1, 2], dtype=np.int32))
    # last token 3, draft [5, 6]: 5 accepted, 6 rejected -> restore, replay [3, 5] before the next rows
    out = runner.step([StepItem(0, np.array([3, 5, 6], dtype=np.int32), 2, n_draft=2)])
    assert out.results[0].tokens.tolist() == [5, 5] and out.results[0].n_replay == 2
    assert out.rollback.restores == 1 and out.rollback.saves == 1
    window = runner.sessions[0].window.tolist()
    runner.step([StepItem(0, np.array([5], dtype=np.int32), 4, n_draft=0)])
    assert [(r[1], r[2]) for r in ctx.decoded[-1]] == [(3, 2), (5, 3), (5, 4)]  # replay, then its own row
    assert runner.sessions[0].window.tolist() == window + [5]  # the replayed tokens are not pushed again


# ---- a recurrent draft model (the `draft` speculator's own context: native/slot_backend.py) ---------------
def _draft_engine(target, draft_path: str, slots: int, **kw) -> LocalEngine:
    from specray.engine.config import DraftModelConfig

    cfg = EngineConfig(model=target.path, slots=slots, n_ctx=512 * slots, calibrate=False,
                       draft=DraftModelConfig(model=draft_path),
                       chain=ChainConfig(speculators=["draft"], policy="first", n_max=6,
                                         params={"draft": {"n_max": 6, "p_min": 0.0}}), **kw)
    return LocalEngine(cfg, model=target)


@pytest.mark.parametrize("target,draft", [("mamba2", "lfm2"), ("lfm2", "mamba2")])
def test_a_recurrent_draft_model_comes_back_to_its_checkpoint(models, target, draft):
    """A recurrent (or hybrid) draft model: drafts rejected in part are taken back out of its state by
    restoring the checkpoint saved where the committed tokens end (never by clearing it), and the target's
    output is unchanged."""
    eng = _draft_engine(models[target], models[draft].path, 2)
    try:
        base = [s.generated for s in _run(eng, ())]
        seqs = _run(eng, ("draft",))
        assert [s.generated for s in seqs] == base
        backend = eng.parts.draft_model.backend
        assert backend.checkpoints is not None
        assert sum(s.spec_total.drafted for s in seqs) > sum(s.spec_total.accepted for s in seqs) > 0
        assert backend.restores > 0 and backend.clears == 0
    finally:
        eng.close()


def test_a_recurrent_draft_model_catches_up_from_its_checkpoint(models, monkeypatch):
    """Self-drafting (the target as its own draft model) with target sampling, so drafts are rejected in part.
    Coming back to the checkpoint, the draft model re-decodes only the accepted tokens past it, and no draft
    decode fails. Ignoring the refused tail removal (what the draft speculator did before) leaves the state
    past the rejected tokens: llama.cpp refuses the next decode (positions out of order), and the speculator
    must clear the sequence and decode its whole history again."""
    sp = SamplingParams(temperature=0.7, seed=3)

    def run(broken: bool):
        eng = _draft_engine(models["mamba2"], models["mamba2"].path, 2)
        try:
            backend = eng.parts.draft_model.backend
            if broken:
                ctx = backend.ctx
                monkeypatch.setattr(backend, "seq_rm", lambda seq_id, p0: (ctx.seq_rm(seq_id, p0, -1), p0)[1])
            seqs = _run(eng, ("draft",), sp)
            spec = eng.chain.speculator("draft")
            return seqs, spec.counters, sum(s.spec_total.accepted for s in seqs)
        finally:
            eng.close()

    seqs, right, accepted = run(False)
    _, wrong, _ = run(True)
    assert accepted > 0 and all(len(s.generated) == MAX_TOKENS for s in seqs)
    assert right.failures == 0 and wrong.failures > 0
    # catch-up: the prompts, then about the accepted tokens; broken: whole histories again after each failure
    assert right.catchup_tokens < wrong.catchup_tokens
