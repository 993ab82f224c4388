"""n > 1: sequences sharing one prompt's KV cells (engine/prompt_share.py, llama.cpp's seq_cp), SmolLM2.

Each sibling copies the first sequence's prompt cells and decodes the last prompt token itself, with its own
seed: its output must be what the same request alone gives (exact mode: token for token, with a KV stream per
slot, where the copy is a whole-stream copy). Fast mode (one unified KV pool, the cells shared) is not batch
invariant (a row's logits move with the batch it is in, by up to ~1 on SmolLM2): there greedy output may part
from the solo run only where the solo run's top-2 logit margin was within twice that.
"""

from __future__ import annotations

import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.sampling import SamplingParams

from ..conftest import spec_bench_prompts
from .test_lossless import ALL, PARAMS

pytestmark = pytest.mark.model

PROMPT = spec_bench_prompts(1)[0]
TIE_BOUND = 2.5  # twice SmolLM2's measured batch variance (~1.0), as `specray bench` derives its tie bound


def _engine(model, exact: bool) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=4, n_ctx=4096, exact=exact, calibrate=False, prompt_cache=False,
                       record_margins=True,
                       chain=ChainConfig(speculators=list(ALL), params=PARAMS, policy="first", n_max=8))
    return LocalEngine(cfg, model=model)


def _req(engine, seed, key=None, chain=None, temperature=0.8):
    r = engine.request(messages=[{"role": "user", "content": PROMPT}], max_tokens=40, chain=chain,
                       sampling=SamplingParams(temperature=temperature, top_k=40, seed=seed))
    r.share_prompt = key
    return r


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_siblings_copy_the_prompt_and_equal_solo_runs(smollm2, exact):
    eng = _engine(smollm2, exact)
    try:
        seeds = [11, 12, 13]
        temperature = 0.8 if exact else 0.0  # fast mode: greedy, so a drift can only show at a near-tie
        solo = [eng.run([_req(eng, s, temperature=temperature)])[0] for s in seeds]
        group = eng.run([_req(eng, s, key="g1", temperature=temperature) for s in seeds])
        n_prompt = len(group[0].req.prompt_tokens)
        assert group[0].cached_tokens == 0 and all(s.cached_tokens == n_prompt - 1 for s in group[1:])
        if exact:
            assert [s.generated for s in group] == [s.generated for s in solo]
        for g, s in zip(group, solo):
            differ = [i for i, (a, b) in enumerate(zip(g.generated, s.generated)) if a != b]
            assert not differ or s.margins[differ[0]] < TIE_BOUND, (differ[0], s.margins[differ[0]])
        if exact:  # different seeds: different samples (the copy did not share a sampler)
            assert len({tuple(s.generated) for s in group}) > 1
        # speculation on in every sibling, and nothing left behind for a later request
        assert all(s.spec_total.drafted > 0 for s in group)
        if exact:
            assert eng.run([_req(eng, 11, temperature=temperature)])[0].generated == solo[0].generated
    finally:
        eng.close()


def test_a_sibling_whose_source_is_gone_prefills_alone(smollm2):
    eng = _engine(smollm2, True)
    try:
        a = _req(eng, 1, key="g2")
        a.max_tokens = 1  # finishes in its prefill round, before the sibling can copy
        b = _req(eng, 2, key="g2")
        sa, sb = eng.run([a, b])
        assert sb.cached_tokens == 0 and sb.finish_reason in ("length", "stop")
        assert sb.generated == eng.run([_req(eng, 2)])[0].generated
    finally:
        eng.close()
