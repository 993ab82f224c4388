"""Shape-stable verifies (EngineConfig.verify_shape="bucketed") on SmolLM2 with real prompts, 4 sequences at once.

Lossless as test_lossless.py holds plain verifies to it: exact mode token-identical to target-only
decoding, fast mode diverging only at near-ties. Pad rows leave no KV cell behind, and every
decode-only round's batch is one of the bucket shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.bench.run import classify_divergence, measure_batch_variance, measure_layout_variance
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts
from .test_lossless import ALL, MAX_TOKENS, PARAMS

pytestmark = pytest.mark.model

SPEC = ("ngram_mod", "suffix")
N_PROMPTS = 6
# the default buckets, and buckets without 1: rounds without drafts are padded too (the "same k+1 rows")
BUCKETS = [(1, 2, 4, 8, 16), (4, 8)]


def _engine(model, exact: bool, buckets: tuple[int, ...] | None, slots: int = 4, policy: str = "first",
            speculators: tuple[str, ...] = ()) -> LocalEngine:
    shape = {"verify_shape": "bucketed", "verify_buckets": buckets} if buckets else {}
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=1024 * slots, exact=exact, record_margins=True,
                       calibrate=False, **shape,
                       chain=ChainConfig(speculators=list(speculators), params=PARAMS, policy=policy, n_max=8))
    return LocalEngine(cfg, model=model)


def _run(engine: LocalEngine, prompts: list[str], chain: tuple[str, ...]):
    return engine.run([engine.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain)
                       for p in prompts])


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(N_PROMPTS)


@pytest.fixture(scope="module")
def exact_baseline(smollm2, prompts):
    eng = _engine(smollm2, exact=True, buckets=None)  # target-only, plain verifies
    out = [s.generated for s in _run(eng, prompts, ())]
    eng.close()
    return out


def _assert_speculated(eng: LocalEngine, seqs) -> None:
    assert eng.runner.max_seqs_in_decode >= 4  # sequences really shared batches
    assert eng.runner.pad_rows > 0, "nothing was padded: the test would prove nothing"
    drafted = sum(s.spec_total.drafted for s in seqs)
    assert 0 < sum(s.spec_total.accepted for s in seqs) < drafted  # acceptance and rollback both exercised


@pytest.mark.parametrize("buckets", BUCKETS, ids=lambda b: ",".join(map(str, b)))
@pytest.mark.parametrize("chain", [SPEC, ALL], ids=lambda c: ",".join(c))
def test_exact_mode_bucketed_is_token_identical(smollm2, prompts, exact_baseline, chain, buckets):
    eng = _engine(smollm2, exact=True, buckets=buckets)
    seqs = _run(eng, prompts, chain)
    for i, s in enumerate(seqs):
        assert s.generated == exact_baseline[i], f"prompt {i} diverged under {chain}, buckets {buckets}"
    _assert_speculated(eng, seqs)
    eng.close()


def test_exact_mode_bucketed_cost_policy_is_token_identical(smollm2, prompts, exact_baseline):
    # the cost policy prices the padded shape (drafting up to the bucket is free): still lossless
    eng = _engine(smollm2, exact=True, buckets=BUCKETS[0], policy="cost", speculators=SPEC)
    seqs = _run(eng, prompts, SPEC)
    for i, s in enumerate(seqs):
        assert s.generated == exact_baseline[i], f"prompt {i} diverged under the cost policy, bucketed"
    assert sum(s.spec_total.accepted for s in seqs) > 0
    eng.close()


def test_fast_mode_bucketed_divergences_only_at_near_ties(smollm2, prompts):
    plain = _engine(smollm2, exact=False, buckets=None)
    prefix = plain.prompt_tokens(messages=[{"role": "user", "content": prompts[0]}])
    tie_bound = 2.0 * max(measure_batch_variance(plain, prefix), measure_layout_variance(plain, prefix))
    base = _run(plain, prompts, ())
    plain.close()
    eng = _engine(smollm2, exact=False, buckets=BUCKETS[0])
    spec = _run(eng, prompts, SPEC)
    _assert_speculated(eng, spec)
    kinds = [classify_divergence(b.generated, s.generated, b.margins, tie_bound) for b, s in zip(base, spec)]
    print(f"\nfast mode, bucketed verifies: tie bound {tie_bound:.3f}, outcomes {kinds}")
    assert "mismatch" not in kinds
    eng.close()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_pad_rows_leave_no_kv_cells_and_rounds_keep_bucket_shapes(smollm2, prompts, exact):
    buckets = BUCKETS[0]
    eng = _engine(smollm2, exact=exact, buckets=buckets)
    seen: list[tuple[bool, int, list[int], int]] = []  # (decode-only, items, batch sizes, real rows)
    step = eng.runner.step

    def recording_step(items):
        out = step(items)
        decode_only = all(it.sample and it.n_commit == 1 for it in items)
        seen.append((decode_only, len(items), list(out.batch_sizes), sum(len(it.tokens) for it in items)))
        return out

    eng.scheduler.target.step = recording_step
    seqs = [eng.submit(eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=SPEC))
            for p in prompts]
    checked = 0
    while eng.scheduler.has_work():
        eng.step()
        for slot, s in eng.scheduler.active.items():
            if s.state == SeqState.DECODING:  # KV cells used == committed tokens: no pad (or rejected) cell left
                assert eng.ctx.seq_pos_min(slot) == 0 and eng.ctx.seq_pos_max(slot) + 1 == s.n_past, slot
                checked += 1
    assert checked > 50 and all(s.finished for s in seqs)
    decode_rounds = [(n, sizes, real) for only, n, sizes, real in seen if only]
    assert sum(1 for n, sizes, real in decode_rounds if sizes[0] > real) > 10  # rounds that were padded
    for n, sizes, _ in decode_rounds:
        assert len(sizes) == 1 and sizes[0] % n == 0 and sizes[0] // n in buckets, (n, sizes)
    assert len({sizes[0] // n for n, sizes, _ in decode_rounds}) >= 2  # drafts of several lengths were bucketed
    prompt_rounds = [(sizes, real) for only, _, sizes, real in seen if not only]
    assert prompt_rounds and all(sum(sizes) == real for sizes, real in prompt_rounds)  # never padded
    eng.close()


def test_target_service_builds_its_runner_with_the_buckets():
    # the target actor (distributed mode) gets the EngineConfig as a dict and builds its own runner from it
    from specray.deployments.actors.target import TargetService

    cfg = EngineConfig(model="smollm2-135m", slots=1, n_ctx=512, calibrate=False, verify_shape="bucketed",
                       verify_buckets=(1, 4))
    svc = TargetService(cfg.model_dump())
    try:
        assert svc.counters()["verify_buckets"] == [1, 4]
        assert svc.runner.verify_buckets == (1, 4)
        from specray.engine.sampling import SamplingParams
        from specray.engine.target import StepItem

        prompt = np.arange(100, 120, dtype=np.int32)
        svc.start_many([(0, SamplingParams(), prompt, 0)])
        out, _ = svc.step([StepItem(0, prompt, 0)])  # a prompt round: not padded
        assert out.batch_sizes == [20]
        nxt = out.results[0].tokens
        out, _ = svc.step([StepItem(0, np.array([nxt[-1], 7], dtype=np.int32), 20, n_draft=1)])
        assert out.batch_sizes == [4] and svc.counters()["pad_rows"] == 2
        assert svc.counters()["kv_cells"][0] == 21 + out.results[0].n_accepted
    finally:
        svc.ctx.close()
