"""ValueEstimates.estimate's compiled core (engine/policy/_estimate_core.c) against estimate_reference
(AcceptanceTracker.prefix_probs, then PrefixCalibration.apply): bitwise the same raw and calibrated arrays for
every state, context, sequence and length, and the policy plans the same drafts with either."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.policy import estimates
from specray.engine.policy.estimates import ValueEstimates


def test_the_core_is_built():
    """setup (pip install) builds it: a tree where it is missing would estimate every draft interpreted."""
    assert estimates.COMPILED_CORE, "not built: docs/troubleshooting.md, 'The compiled cores were not built'"


def trained(seed: int) -> ValueEstimates:
    """Estimates of two speculators after a few hundred judged, sent and calibrated drafts: every state and many
    contexts seen, per-sequence rates apart from the global one, calibration factors apart from 1."""
    rng = np.random.default_rng(seed)
    e = ValueEstimates()
    for _ in range(400):
        name = str(rng.choice(["a", "b"]))
        k = int(rng.integers(1, 40))
        d = rng.integers(0, 3, k).astype(np.int32)
        emitted = np.concatenate([d[: int(rng.integers(0, k + 1))], [7]]).astype(np.int32)
        e.judged(name, int(rng.integers(0, 5)), d, emitted[: int(rng.integers(1, len(emitted) + 1))],
                 int(rng.integers(0, 12)))
        if rng.random() < 0.5:
            e.calibrate(name, np.cumprod(rng.uniform(0.4, 1.0, k)), int(rng.integers(0, k + 1)))
    return e


@pytest.mark.parametrize("seed", range(4))
def test_the_core_estimates_what_the_reference_estimates(seed):
    e = trained(seed)
    factors = e.calibration("a").factor_list()
    assert len(set(factors)) > 2  # the calibration moved, bucket by bucket
    for name in ("a", "b", "unseen"):
        for seq_id in range(7):  # 5 and 6 never seen
            for length in (1, 2, 3, 7, 8, 9, 16, 40, 256, 300):  # past the tracker's 256 positions too
                for context in (-1, 0, 5, 11, 40):  # out of range: clamped
                    raw, cal = e.estimate(name, seq_id, length, context)
                    want_raw, want_cal = e.estimate_reference(name, seq_id, length, context)
                    assert np.array_equal(raw, want_raw) and np.array_equal(cal, want_cal), (name, seq_id, length)
                    assert raw.dtype == cal.dtype == np.float64 and len(raw) == len(cal) == length
    raw, cal = e.estimate("a", 0, 0)
    assert len(raw) == len(cal) == 0


def test_the_core_buckets_positions_as_the_tracker():
    """Position j's bucket (0, 1, 2-3, 4-7, ...): a calibration factor that differs in every bucket shows the bucket
    of each of 5,000 positions in the calibrated estimate."""
    e = ValueEstimates()
    c = e.calibration("a")
    c.predicted[:] = 100.0
    c.realised[:] = np.linspace(60.0, 100.0, len(c.realised))  # factors 0.6 .. 1.0, one per bucket
    raw, cal = e.estimate("a", 0, 5000)
    want_raw, want_cal = e.estimate_reference("a", 0, 5000)
    assert np.array_equal(raw, want_raw) and np.array_equal(cal, want_cal)


def test_the_core_refuses_what_it_cannot_read():
    core = pytest.importorskip("specray.engine.policy._estimate_core")
    z = np.zeros(8)
    with pytest.raises(ValueError):
        core.estimate(np.zeros((2, 4)), z, z, z[:4], z, 0.5, 4.0, 8.0, 1.0, [1.0] * 8)  # a short cell row
    with pytest.raises(ValueError):
        core.estimate(np.zeros((2, 4)), z, z, z, z, 0.5, 4.0, 8.0, 1.0, [1.0] * 7)  # a factor missing
    with pytest.raises(ValueError):
        core.estimate(np.zeros((2, 4), np.float32), z, z, z, z, 0.5, 4.0, 8.0, 1.0, [1.0] * 8)


def test_the_policy_drafts_alike_with_either():
    """The chain learning over many rounds (estimates feed scoring, planning and the verdicts feed the
    estimates): the same drafts sent, round for round."""
    from specray.engine.chain import Chain
    from specray.engine.config import ChainConfig
    from specray.engine.policy import DraftPolicy, SeqDraftRequest
    from specray.engine.policy.acceptance import judge
    from specray.engine.policy.policy import Room
    from specray.engine.speculators.registry import speculator_factory

    rng = np.random.default_rng(5)
    texts = [np.tile(rng.integers(0, 30, int(rng.integers(20, 60))), 12).astype(np.int32) for _ in range(4)]
    sent = {}
    for compiled in (True, False):
        ValueEstimates.compiled = compiled
        try:
            names = ("ngram_mod", "suffix", "ngram_cache")
            chain = Chain(ChainConfig(speculators=list(names)), speculator_factory())
            from specray.engine.cost import DecodeCostModel
            policy = DraftPolicy(chain, DecodeCostModel(learn=False))
            pos = {s: 40 for s in range(4)}
            for s in range(4):
                chain.begin(s, names, texts[s][:40])
            out = []
            for _ in range(60):
                reqs = [SeqDraftRequest(s, names, texts[s][: pos[s]], 16) for s in range(4)]
                for p, r in zip(policy.plan_round(reqs, Room(free_rows=64, base_rows=4, cells=300.0)), reqs):
                    truth = texts[r.seq_id][pos[r.seq_id] : pos[r.seq_id] + len(p.tokens) + 1]
                    m, _ = judge(p.tokens, truth)
                    policy.accept(p, len(p.tokens), m, truth[: m + 1])
                    pos[r.seq_id] += m + 1
                    out.append((p.speculator, p.tokens.tolist()))
            sent[compiled] = out
        finally:
            ValueEstimates.compiled = True
    assert sent[True] == sent[False]
    assert sum(len(t) for _, t in sent[True]) > 100  # it drafted
