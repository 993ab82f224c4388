"""Context shift with a real model: a generation that runs past its context goes on, losslessly.

SmolLM2 in exact mode (batch-invariant, one KV stream per slot) with 256 cells per slot; 400 tokens past a
short prompt shift each sequence more than once. Greedy output with speculation on (the default chain, and
the `draft` speculator with SmolLM2 drafting for itself) must equal output without it, with 1 and 2 slots:
the shift falls on the same token either way (a verify never crosses the context).
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts

pytestmark = pytest.mark.model

CELLS = 256  # per slot
MAX_TOKENS = 400
DEFAULT_CHAIN = ("ngram_mod", "suffix", "ngram_cache", "grammar")
# aggressive parameters (as test_lossless): short matches draft, so drafts are made and some rejected
PARAMS = {"ngram_mod": {"n_match": 3, "n_min": 1, "n_max": 8, "pool_size": 1 << 16},
          "ngram_cache": {"n_draft": 6}, "suffix": {"min_match": 1, "p_min": 0.01}}


def engine(model, slots: int, shift: bool = True, draft: str | None = None, **kw) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=CELLS * slots, exact=True, calibrate=False,
                       context_shift=shift, chain=ChainConfig(speculators=[], params=PARAMS, policy="first", n_max=8),
                       draft=DraftModelConfig(model=draft), **kw)
    return LocalEngine(cfg, model=model)


def run(eng: LocalEngine, prompts: list[str], chain: tuple[str, ...], check=None):
    reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                        ignore_eos=True) for p in prompts]
    seqs = [eng.submit(r) for r in reqs]
    while eng.scheduler.has_work():
        eng.step()
        if check is not None:
            check(eng)
    return seqs


def check_kv(eng: LocalEngine) -> None:
    """Every decoding sequence's KV holds n_past cells, at positions 0..n_past-1 (shifted ones included)."""
    for slot, seq in eng.scheduler.active.items():
        if seq.state == SeqState.DECODING:
            assert seq.n_past < CELLS
            assert eng.ctx.seq_pos_max(slot) + 1 == seq.n_past
            assert len(seq.kv_history()) == seq.n_past + 1


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(2)


@pytest.fixture(scope="module")
def baseline(smollm2, prompts):
    eng = engine(smollm2, slots=1)
    seqs = [run(eng, [p], ())[0] for p in prompts]
    eng.close()
    assert all(s.shifts >= 2 and len(s.generated) == MAX_TOKENS for s in seqs)
    return [s.generated for s in seqs]


def test_shifted_generation_runs_past_the_context(smollm2, prompts, baseline):
    eng = engine(smollm2, slots=1)
    s = run(eng, prompts[:1], (), check_kv)[0]
    assert s.finish_reason == "length" and len(s.generated) == MAX_TOKENS
    assert len(s.req.prompt_tokens) + MAX_TOKENS > CELLS
    assert eng.scheduler.stats.context_shifts == s.shifts >= 2
    assert s.shift_keep == 1  # n_keep 0 + the BOS token
    assert s.generated == baseline[0]  # deterministic
    eng.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_default_chain_with_shifts_equals_plain_decoding(smollm2, prompts, baseline, slots):
    eng = engine(smollm2, slots=slots)
    seqs = run(eng, prompts, DEFAULT_CHAIN, check_kv) if slots > 1 else [
        run(eng, [p], DEFAULT_CHAIN, check_kv)[0] for p in prompts]
    for i, s in enumerate(seqs):
        assert s.generated == baseline[i], f"prompt {i} diverged"
        assert s.shifts >= 2
    assert sum(s.spec_total.accepted for s in seqs) > 0  # speculation really ran
    if slots > 1:
        assert eng.runner.max_seqs_in_decode >= 2
    eng.close()


def check_draft_mirror(eng: LocalEngine) -> None:
    """The draft cache of a shifted sequence lines up with the target's shifted KV: never a token the target
    does not hold at that position."""
    spec = eng.chain.speculator("draft")
    for slot, seq in eng.scheduler.active.items():
        if seq.state != SeqState.DECODING or slot not in spec.seqs:
            continue
        kv_target = seq.kv_history()[: seq.n_past]
        assert spec.committed(slot).tolist() == kv_target.tolist()
        kv = spec.kv_tokens(slot)
        assert kv.tolist() == kv_target[: len(kv)].tolist()
        assert eng.draft_model.backend.pos_max(slot) + 1 == len(kv)


@pytest.mark.parametrize("slots", [1, 2])
def test_draft_model_with_shifts_equals_plain_decoding(smollm2, prompts, baseline, slots):
    eng = engine(smollm2, slots=slots, draft="smollm2-135m")
    seqs = run(eng, prompts[:slots], ("draft",), check_draft_mirror)
    for i, s in enumerate(seqs):
        assert s.generated == baseline[i], f"prompt {i} diverged"
        assert s.shifts >= 2
    spec = eng.chain.speculator("draft")
    assert sum(s.spec_by_name["draft"].accepted for s in seqs if "draft" in s.spec_by_name) > 0
    assert spec.counters.failures == 0
    # the draft cache was shifted, not rebuilt: catch-up stays far below re-decoding the context per shift
    assert spec.counters.unsynced == 0
    assert spec.counters.catchup_tokens < sum(len(s.req.prompt_tokens) + MAX_TOKENS for s in seqs)
    eng.close()


def test_without_the_option_a_request_must_fit(smollm2, prompts):
    eng = engine(smollm2, slots=1, shift=False)
    req = eng.request(messages=[{"role": "user", "content": prompts[0]}], max_tokens=MAX_TOKENS, ignore_eos=True)
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.submit(req)
    # as before: a request that fits ends with "length" at max_tokens, never shifted
    s = eng.generate(messages=[{"role": "user", "content": prompts[0]}], max_tokens=64, ignore_eos=True)
    assert s.finish_reason == "length" and s.shifts == 0 and eng.scheduler.stats.context_shifts == 0
    # a request may turn shifting on for itself
    req.context_shift = True
    s = eng.run([req])[0]
    assert s.finish_reason == "length" and len(s.generated) == MAX_TOKENS and s.shifts >= 2
    eng.close()


def test_request_n_keep_and_n_discard(smollm2, prompts):
    eng = engine(smollm2, slots=1)
    req = eng.request(messages=[{"role": "user", "content": prompts[0]}], max_tokens=MAX_TOKENS, ignore_eos=True)
    req.n_keep, req.n_discard = -1, 32  # keep the whole prompt, 32 tokens per shift
    s = eng.run([req])[0]
    assert s.shift_keep == len(req.prompt_tokens)
    assert s.shifted == 32 * s.shifts and s.shifts >= 5
    assert np.array_equal(s.kv_history()[: s.shift_keep], req.prompt_tokens)
    eng.close()


def test_prompt_cache_reuses_only_the_kept_front(smollm2, prompts):
    eng = engine(smollm2, slots=1)
    first = run(eng, prompts[:1], ())[0]
    assert first.shifts > 0
    # the next turn: the same prompt and what was generated. The cells past the kept front attended to discarded
    # tokens and were moved: only the front may be reused
    follow = np.concatenate([first.req.prompt_tokens, np.asarray(first.generated[:100], dtype=np.int32)])
    req = eng.request(messages=[{"role": "user", "content": "x"}], max_tokens=8)
    req.prompt_tokens = follow
    s = eng.run([req])[0]
    assert s.cached_tokens <= first.shift_keep
    fresh = engine(smollm2, slots=1, prompt_cache=False)
    req2 = fresh.request(messages=[{"role": "user", "content": "x"}], max_tokens=8)
    req2.prompt_tokens = follow
    assert fresh.run([req2])[0].generated == s.generated
    fresh.close()
    eng.close()


def test_dflash_window_follows_the_shifts(smollm2, prompts, baseline):
    """The `dflash` speculator keeps target feature rows by position: a shift moves its window and cache
    (engine/feature_window.py), so its window ends where the target's KV does after every round."""
    from specray.engine.config import HiddenStateConfig

    from ..hidden_models import dflash_draft

    eng = engine(smollm2, slots=2, hidden=HiddenStateConfig(dflash_model=dflash_draft("dflash")))
    spec = eng.chain.speculator("dflash")

    def check(e: LocalEngine) -> None:
        check_kv(e)
        for slot, seq in e.scheduler.active.items():
            if seq.state == SeqState.DECODING and slot in spec.seqs and not spec.seqs[slot].lost:
                w = spec.seqs[slot].window
                assert w.end == seq.n_past and w.injected <= seq.n_past, (slot, w.end, seq.n_past)

    seqs = run(eng, prompts, ("dflash",), check)
    for i, s in enumerate(seqs):
        assert s.generated == baseline[i], f"prompt {i} diverged"
        assert s.shifts >= 2
    assert spec.counters.shifts >= 4 and spec.counters.blocks > 0 and spec.counters.lost == 0
    eng.close()
