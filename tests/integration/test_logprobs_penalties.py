"""logprobs, presence/frequency penalties and logit_bias with speculation on (SmolLM2, several sequences).

Exact mode (batch-invariant target): each emitted token's log-probability comes from the verify row it was
chosen from, so speculation must report exactly the numbers target-only decoding reports; penalties and biases
must shape the verify exactly as they shape target-only decoding, so output stays token for token the same.
Fast mode: the logprobs of tokens both runs emitted differ by at most the logits' measured drift.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.bench.run import measure_batch_variance, measure_layout_variance
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.sampling import SamplingParams

from ..conftest import spec_bench_prompts
from .test_lossless import ALL, PARAMS

pytestmark = pytest.mark.model

MAX_TOKENS = 48
PROMPTS = spec_bench_prompts(4) + ["Repeat after me five times: the cat sat on the mat."]


def _engine(model, exact: bool = True) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=4, n_ctx=4096, exact=exact, calibrate=False,
                       chain=ChainConfig(speculators=[], params=PARAMS, policy="first", n_max=8))
    return LocalEngine(cfg, model=model)


def _run(engine: LocalEngine, chain: tuple[str, ...], sampling: SamplingParams):
    reqs = [engine.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                           sampling=sampling) for p in PROMPTS]
    return engine.run(reqs)


def _flat(seq):
    lp = seq.logprobs
    return (np.concatenate([c.logprob for c in lp]), np.concatenate([c.top_ids for c in lp]),
            np.concatenate([c.top_logprobs for c in lp]))


@pytest.fixture(scope="module")
def exact_engine(smollm2):
    eng = _engine(smollm2)
    yield eng
    eng.close()


def test_logprobs_with_speculation_equal_target_only(exact_engine):
    sp = SamplingParams(logprobs=5)
    base = _run(exact_engine, (), sp)
    spec = _run(exact_engine, ALL, sp)
    assert sum(s.spec_total.accepted for s in spec) > 0  # accepted draft tokens' logprobs were reported
    for b, s in zip(base, spec):
        assert s.generated == b.generated
        lp_b, ids_b, top_b = _flat(b)
        lp_s, ids_s, top_s = _flat(s)
        assert len(lp_s) == len(s.generated) and ids_s.shape == (len(s.generated), 5)
        np.testing.assert_array_equal(lp_s, lp_b)
        np.testing.assert_array_equal(ids_s, ids_b)
        np.testing.assert_array_equal(top_s, top_b)
        # greedy: the chosen token is the most likely one, and a distribution's top 5 hold at most all its mass
        assert (ids_s[:, 0] == np.asarray(s.generated)).all() and np.allclose(lp_s, top_s[:, 0])
        assert (np.exp(top_s).sum(axis=1) <= 1.0 + 1e-9).all() and (lp_s <= 0).all()
    off = _run(exact_engine, ALL, SamplingParams())
    assert all(s.logprobs == [] for s in off)  # not asked: not computed


def test_penalties_and_logit_bias_with_speculation_equal_target_only(exact_engine):
    plain = [s.generated for s in _run(exact_engine, (), SamplingParams())]
    banned = plain[4][3]  # a token the unbiased repeat prompt emits
    sp = SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repeat_last_n=64,
                        logit_bias={banned: -100.0, 28: 2.0})
    base = [s.generated for s in _run(exact_engine, (), sp)]
    spec = _run(exact_engine, ALL, sp)
    assert sum(s.spec_total.drafted for s in spec) > sum(s.spec_total.accepted for s in spec) > 0
    assert [s.generated for s in spec] == base
    assert base != plain and all(banned not in b for b in base)  # they did change the output
    # sampled: each position's draw depends only on (seed, position, adjusted logits)
    sp = sp.model_copy(update={"temperature": 0.8, "top_k": 40, "seed": 11})
    assert [s.generated for s in _run(exact_engine, ALL, sp)] == [s.generated for s in _run(exact_engine, (), sp)]


def test_fast_mode_logprobs_within_the_logits_drift(smollm2):
    eng = _engine(smollm2, exact=False)
    try:
        prefix = eng.prompt_tokens(messages=[{"role": "user", "content": PROMPTS[0]}])
        drift = max(measure_batch_variance(eng, prefix), measure_layout_variance(eng, prefix))
        sp = SamplingParams(logprobs=0)
        base, spec = _run(eng, (), sp), _run(eng, ALL, sp)
        compared = 0
        for b, s in zip(base, spec):
            n = next((i for i, (x, y) in enumerate(zip(b.generated, s.generated)) if x != y),
                     min(len(b.generated), len(s.generated)))
            d = np.abs(_flat(b)[0][:n] - _flat(s)[0][:n])
            # a log-softmax moves by at most twice the largest logit change
            assert (d <= 2 * drift + 1e-6).all(), (d.max(), drift)
            compared += n
        assert compared >= 20  # tokens both runs emitted before any near-tie divergence
    finally:
        eng.close()


def test_echo_prompt_logprobs_across_prefill_chunks(smollm2):
    """The prompt's own logprobs (echo) come from every prompt row, chunk boundaries included: prefilled in
    chunks of 16 or all at once (exact mode), the same numbers; the first prompt token has none."""
    sp = SamplingParams(logprobs=2, prompt_logprobs=True)
    got = []
    for chunk in (256, 16):
        cfg = EngineConfig(model="smollm2-135m", slots=2, n_ctx=2048, exact=True, calibrate=False, prefill_chunk=chunk)
        eng = LocalEngine(cfg, model=smollm2)
        try:
            seqs = _run(eng, ("ngram_mod",), sp)
            got.append([(np.concatenate([c.logprob for c in s.prompt_logprobs]), len(s.req.prompt_tokens))
                        for s in seqs])
        finally:
            eng.close()
    for (a, n), (b, _) in zip(*got):
        assert len(a) == n - 1 and (a <= 0).all()
        np.testing.assert_array_equal(a, b)
