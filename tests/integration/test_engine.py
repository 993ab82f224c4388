"""The in-process engine with the real model: sampling reproducibility, stops, errors."""

from __future__ import annotations

import pytest

from specray.bench.run import divergence_margin
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.sampling import SamplingParams

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def engine(smollm2):
    cfg = EngineConfig(slots=2, n_ctx=2048, calibrate=False, exact=True,
                       chain=ChainConfig(speculators=["ngram_simple", "suffix"], policy="first",
                                         params={"ngram_simple": {"size_n": 2}, "suffix": {"min_match": 1}}))
    eng = LocalEngine(cfg, model=smollm2)
    yield eng
    eng.close()


def test_sampling_with_a_seed_is_reproducible_with_speculation(engine):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    a = engine.generate(messages=CHAT, max_tokens=48, sampling=sp)
    b = engine.generate(messages=CHAT, max_tokens=48, sampling=sp)
    c = engine.generate(messages=CHAT, max_tokens=48, sampling=sp.model_copy(update={"seed": 99}))
    assert a.generated == b.generated
    assert a.generated != c.generated
    assert len(a.generated) > 10


def test_seeded_sampling_is_the_same_with_and_without_speculation(engine):
    # each position's draw depends only on (seed, position, logits): drafts cannot change it
    sp = SamplingParams(temperature=0.8, seed=7)
    plain = engine.generate(messages=CHAT, max_tokens=48, sampling=sp, chain=())
    spec = engine.generate(messages=CHAT, max_tokens=48, sampling=sp)
    assert spec.generated == plain.generated
    assert spec.spec_total.drafted > 0


def test_max_tokens_and_stop_strings(engine):
    s = engine.generate(messages=CHAT, max_tokens=5)
    assert len(s.generated) == 5 and s.finish_reason == "length"
    full = engine.generate(messages=CHAT, max_tokens=40)
    words = full.text.split()
    assert len(words) > 4
    stop = words[3]
    cut = engine.generate(messages=CHAT, max_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text)


def test_eos_finishes_with_stop(engine):
    # with its template's default system prompt this 135M model loops on this question ("la Femme, la
    # Femme, ..."); a system message of our own gets the short answer
    s = engine.generate(messages=[{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": "What is the capital of France?"}], max_tokens=128)
    assert s.finish_reason == "stop" and len(s.generated) < 128, s.text
    assert "Paris" in s.text


def test_a_stop_on_eos_keeps_the_margin_where_it_stopped(smollm2):
    # the bench classifies a divergence by the target-only run's margin where it began; when that run
    # stopped on EOS and a speculative run went on, the EOS position is where they diverged
    eng = LocalEngine(EngineConfig(slots=1, n_ctx=1024, calibrate=False, record_margins=True), model=smollm2)
    try:
        s = eng.generate(messages=[{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "What is the capital of France?"}], max_tokens=128)
    finally:
        eng.close()
    assert s.finish_reason == "stop" and len(s.generated) < 128, s.text
    assert len(s.margins) == len(s.generated) + 1 and s.margins[-1] > 0
    went_on = s.generated + [s.generated[0]]
    assert divergence_margin(s.generated, went_on, s.margins) == s.margins[-1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(messages=CHAT, chain=("ngram_nope",)), "unknown speculator 'ngram_nope'"),
        (dict(messages=CHAT, n_max=-1), "n_max must be >= 0"),
        (dict(messages=CHAT, max_tokens=0), "max_tokens must be >= 1"),
        (dict(prompt="word " * 1200), "does not fit the context"),
        (dict(messages=CHAT, max_tokens=5000), "exceeds the context"),
    ],
)
def test_bad_input_is_a_clear_error(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(engine.request(**kwargs))
    assert not engine.scheduler.has_work()  # nothing half-admitted


def test_bad_speculator_params_name_the_field(smollm2):
    cfg = EngineConfig(calibrate=False, chain=ChainConfig(speculators=["ngram_mod"],
                                                          params={"ngram_mod": {"n_match": 0}}))
    with pytest.raises(ValueError, match="ngram_mod.*n_match"):
        LocalEngine(cfg, model=smollm2)


def test_prefill_rounds_do_not_teach_the_verify_cost_table(engine):
    # prompt rows carry no logits, verify rows do: a prefill round's time per row would underprice drafts
    table = dict(engine.scheduler.cost.table())
    prompt = "Repeat after me: " + " ".join(f"item {i}," for i in range(150))
    seq = engine.generate(prompt=prompt, max_tokens=4, chain=())
    assert seq.n_prefilled > 256  # prefilled in chunks of up to 256 rows (prefill_chunk)
    learnt = engine.scheduler.cost.table()
    assert set(learnt) - set(table) <= {1}  # only the 1-row decode rounds were observed


def test_attention_cost_is_measured_in_a_plausible_band(engine):
    # SmolLM2 here: ~2 us per token x KV cell (4 slots of 64 vs 900 tokens); the per-size medians this
    # replaced came out 0 on some start-ups, which priced long-context draft rows as free
    measured = [engine.runner.measure_attention_cost() for _ in range(2)]
    assert all(2e-7 < a < 2e-5 for a in measured), measured


def test_a_slow_spell_during_calibration_does_not_become_the_cost_shape(engine, monkeypatch):
    # Real decodes, a synthetic clock: a decode of n rows "takes" 10 ms + 8 ms per extra row, and
    # 3x that during a spell of the host. Timed size by size, the spell fell on the 2-row entry and
    # priced it at 2.5x one row (SmolLM2 on a shared VM), which kept every 1-token draft out for
    # the run. Paired with a 1-row decode each, a spell scales both sides of the ratio.
    from specray.engine import target as target_mod

    ctx = engine.runner.ctx
    clock = {"now": 0.0, "decodes": 0}
    real_decode = ctx.decode

    def timed_decode(batch=None):
        out = real_decode(batch)
        n = (batch or ctx.batch).n_tokens
        slow = 3.0 if 10 <= clock["decodes"] < 40 else 1.0
        clock["decodes"] += 1
        clock["now"] += slow * (0.010 + 0.008 * (n - 1))
        return out

    monkeypatch.setattr(ctx, "decode", timed_decode)
    monkeypatch.setattr(target_mod.time, "perf_counter", lambda: clock["now"])
    table = engine.runner.measure_decode_costs(sizes=(1, 2, 4, 8))
    for n, secs in table.items():
        assert secs / table[1] == pytest.approx(1 + 0.8 * (n - 1), rel=1e-6), table


def test_thread_count_defaults_in_process_and_served(smollm2):
    """Unset threads: 2 in process; served, all the CPUs the process may use (docs/serving.md,
    threads when serving); the context is opened with what the config says, and a set value is kept either way."""
    from specray.deployments.builder import build_engine, usable_cpus
    from specray.engine.config import served_threads

    cfg = EngineConfig(slots=1, n_ctx=256, calibrate=False)
    for served, want in ((False, 2), (True, served_threads(usable_cpus()))):
        parts = build_engine(cfg, model=smollm2, served=served)
        try:
            assert parts.config.threads == want and parts.ctx.n_threads == want
        finally:
            parts.close()
    parts = build_engine(cfg.model_copy(update={"threads": 2}), model=smollm2, served=True)
    try:
        assert parts.ctx.n_threads == 2
    finally:
        parts.close()


def test_gpu_layers_default_to_what_this_build_can_offload(smollm2):
    """n_gpu_layers None (the default) is every layer where llama.cpp offloads to a GPU it sees, none
    elsewhere; the loaded model says which it got, and the bench's reference loop follows it."""
    from specray.native import lib

    want = lib.ALL_LAYERS if lib.gpu_offload() else 0
    assert smollm2.n_gpu_layers == want
    assert lib.resolve_gpu_layers(None) == want and lib.resolve_gpu_layers(3) == 3


def test_gpu_split_reaches_llama_model_params():
    """main_gpu / split_mode / tensor_split as llama.cpp reads them (what a model spread over GPUs loads with;
    a CPU build takes and ignores them, so a model still loads: tested on the GPU machine for real)."""
    import ctypes

    import llama_cpp

    from specray.native.model import Model, gpu_split_params

    params = llama_cpp.llama_model_default_params()
    got = gpu_split_params(params, 1, "row", (3, 1))
    assert params.main_gpu == 1 and params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_ROW
    assert [params.tensor_split[i] for i in range(3)] == [3.0, 1.0, 0.0]
    assert got["tensor_split"] == (3.0, 1.0) and isinstance(got["_array"], ctypes.Array)
    with pytest.raises(ValueError, match="split_mode"):
        gpu_split_params(params, 0, "diagonal", None)
    with pytest.raises(ValueError, match="at most"):
        gpu_split_params(params, 0, "layer", (1,) * (llama_cpp.llama_max_devices() + 1))
    m = Model("smollm2-135m", split_mode="none", tensor_split=(1, 1), vocab_only=True)
    assert m.gpu_split["split_mode"] == "none" and m.gpu_split["tensor_split"] == (1.0, 1.0)
