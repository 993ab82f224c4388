"""The draft model's load options with real models: they reach llama.cpp (read back from the draft context and
the model load), a quantised KV cache in the draft context keeps the output lossless, and llama.cpp's own
refusal of a quantised V cache without flash attention is what the config refuses early.

Target SmolLM2 in exact mode (greedy output token-identical to plain decoding), SmolLM2 drafting for it with
several slots sharing each target decode."""

from __future__ import annotations

import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig

from ..conftest import spec_bench_prompts

pytestmark = pytest.mark.model

SLOTS = 3
MAX_TOKENS = 24
N_PROMPTS = 3


def engine(target_model, **draft) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=SLOTS, n_ctx=512 * SLOTS, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=[], policy="first", n_max=6),
                       draft=DraftModelConfig(**draft))
    return LocalEngine(cfg, model=target_model)


def run(eng: LocalEngine, prompts, chain) -> list:
    reqs = [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain)
            for p in prompts]
    return eng.run(reqs)


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(N_PROMPTS)


@pytest.fixture(scope="module")
def baseline(smollm2, prompts):
    eng = engine(smollm2)
    out = [s.generated for s in run(eng, prompts, ())]
    eng.close()
    return out


def kv_bytes(dm, n: int = 40) -> int:
    """Bytes of one sequence's KV state after n tokens: what the cache types really cost in llama.cpp."""
    dm.backend.decode([(0, dm.model.tokenize("a b c d " * 20)[:n], 0)])
    size = len(dm.ctx.state_seq_get(0))
    dm.ctx.clear_seq(0)
    return size


def test_options_reach_the_llama_context_and_model(smollm2):
    from specray.native.draft_backend import DraftModel

    plain = engine(smollm2, model="smollm2-135m")
    opts = dict(model="smollm2-135m", threads=1, threads_batch=2, n_batch=64, n_ubatch=32, n_gpu_layers=3,
                main_gpu=1, cache_type_k="q8_0", cache_type_v="q8_0", n_ctx=384)
    tuned = engine(smollm2, **opts)
    try:
        got = tuned.draft_model.effective_settings()
        # read back from llama.cpp: llama_n_threads / _threads_batch / _batch / _ubatch, and the context size
        assert (got["threads"], got["threads_batch"], got["n_batch"], got["n_ubatch"]) == (1, 2, 64, 32)
        assert got["n_ctx"] == 512  # 384 padded by llama.cpp (native/context.CTX_PAD)
        # the model load: these layers, the whole model on GPU 1 (a CPU build takes and ignores them)
        assert (got["n_gpu_layers"], got["main_gpu"], got["split_mode"]) == (3, 1, "none")
        assert tuned.draft_model.model.gpu_split["main_gpu"] == 1
        # a quantised V cache turned flash attention on for the draft context only
        assert got["flash_attn"] is True and tuned.ctx.flash_attn is False
        assert (got["cache_type_k"], got["cache_type_v"]) == ("q8_0", "q8_0")
        # the cache types are llama.cpp's: q8_0 takes 34 bytes per 32 values where f16 takes 64
        f16, q8 = kv_bytes(plain.draft_model), kv_bytes(tuned.draft_model)
        assert 0.45 < q8 / f16 < 0.6, (q8, f16)
        base = plain.draft_model.effective_settings()
        assert (base["cache_type_k"], base["flash_attn"], base["n_batch"]) == ("f16", False, plain.config.n_batch)
        assert base["threads_batch"] == base["threads"] == plain.config.threads
        assert tuned.draft_model.info()["settings"] == got
    finally:
        plain.close()
        tuned.close()


def test_llama_cpp_itself_refuses_a_quantised_v_cache_without_flash_attention(smollm2):
    """The rule DraftModelConfig checks first (so the options are named): llama.cpp's own, not a guess."""
    from specray.native.context import Context

    with pytest.raises(RuntimeError, match="could not create a context.*V q8_0, flash_attn False"):
        Context(smollm2, n_ctx=256, n_seq_max=1, n_batch=64, type_v="q8_0", flash_attn=False)
    with pytest.raises(ValueError, match="KV cache type must be one of"):
        Context(smollm2, n_ctx=256, n_seq_max=1, n_batch=64, type_k="q3_k")
    ok = Context(smollm2, n_ctx=256, n_seq_max=1, n_batch=64, type_k="q4_0", type_v="q4_0", flash_attn=True)
    ok.close()


@pytest.mark.parametrize("cache", [{"cache_type_k": "q8_0"},
                                   {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "threads_batch": 1}],
                         ids=["q8_0-k", "q8_0-kv-flash"])
def test_quantised_draft_cache_is_lossless_with_several_slots(smollm2, prompts, baseline, cache):
    eng = engine(smollm2, model="smollm2-135m", **cache)
    try:
        seqs = run(eng, prompts, ("draft",))
        assert eng.runner.max_seqs_in_decode >= 2  # the sequences shared target decodes
        for i, s in enumerate(seqs):
            assert s.generated == baseline[i], f"prompt {i} diverged"
        drafted = sum(s.spec_by_name["draft"].drafted for s in seqs if "draft" in s.spec_by_name)
        accepted = sum(s.spec_by_name["draft"].accepted for s in seqs if "draft" in s.spec_by_name)
        assert drafted > 0 and accepted > 0
        assert eng.chain.speculator("draft").counters.failures == 0
        print(f"\n{cache}: {accepted}/{drafted} accepted")
    finally:
        eng.close()


def test_companion_service_loads_the_draft_with_its_options():
    """Distributed mode's companion builds its draft from the same settings (run here without Ray)."""
    from specray.deployments.actors.companion import CompanionService

    cfg = EngineConfig(slots=2, n_ctx=512, calibrate=False, threads=1,
                       draft={"model": "smollm2-135m", "threads_batch": 2, "cache_type_k": "q4_0", "n_ubatch": 128})
    svc = CompanionService(cfg.model_dump())
    try:
        got = svc.info()["draft"]["settings"]
        assert (got["threads"], got["threads_batch"], got["n_ubatch"]) == (1, 2, 128)
        # flash attention follows the target's, on by default outside exact mode
        assert (got["cache_type_k"], got["cache_type_v"], got["flash_attn"]) == ("q4_0", "f16", True)
    finally:
        svc.draft_model.close()
        svc.target_vocab.close()
