"""The `draft` speculator with real models, co-located (in-process).

Exact mode on the target: drafting must give token-identical greedy output.
Same vocabulary: SmolLM2 drafting for itself (its draft context runs in the
fast, not batch-invariant mode, so a few drafts are rejected) and a 20-layer
copy of SmolLM2 (written with `gguf`; most of its drafts are rejected).
Cross vocabulary: SmolLM2 drafting for Gemma 3 270M through text.

After every round the draft KV cache is checked against the target's: it holds
no token the target did not commit, and once the deferred tokens are decoded
(`sync`) its positions equal the target's.
"""

from __future__ import annotations

import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, DraftModelConfig, EngineConfig
from specray.engine.request import SeqState
from specray.engine.vocab import VocabMismatchError

from ..conftest import spec_bench_prompts

pytestmark = pytest.mark.model

N_PROMPTS = 8
SLOTS = 4
MAX_TOKENS = 48
TRUNCATED_LAYERS = list(range(10)) + list(range(20, 30))  # 20 of SmolLM2's 30 blocks


def engine(target_model, target: str, draft: str, cross_vocab: bool = False, policy: str = "first",
           params: dict | None = None, model_explore: float = 0.01) -> LocalEngine:
    cfg = EngineConfig(model=target, slots=SLOTS, n_ctx=1024 * SLOTS, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=[], policy=policy, n_max=8, params=params or {},
                                         model_explore=model_explore),
                       draft=DraftModelConfig(model=draft, cross_vocab=cross_vocab))
    return LocalEngine(cfg, model=target_model)


def requests(eng: LocalEngine, prompts, chain):
    return [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain)
            for p in prompts]


def check_mirror(eng: LocalEngine, sync: bool) -> int:
    """Assert the draft cache of every decoding sequence against the target; returns sequences checked."""
    spec = eng.chain.speculator("draft")
    n = 0
    for slot, seq in eng.scheduler.active.items():
        if seq.state != SeqState.DECODING or slot not in spec.seqs:
            continue
        committed = seq.history_view()[: seq.n_past]  # what the target's KV cache holds
        assert spec.committed(slot).tolist() == committed.tolist()
        assert eng.ctx.seq_pos_max(slot) + 1 == seq.n_past
        if sync:
            spec.sync([slot])
        kv = spec.kv_tokens(slot)
        assert eng.draft_model.backend.pos_max(slot) + 1 == len(kv)
        if spec.translator is None:
            # never a token the target did not commit; after sync, exactly the target's cache
            assert kv.tolist() == committed[: len(kv)].tolist()
            if sync:
                assert len(kv) == seq.n_past == eng.draft_model.backend.pos_max(slot) + 1
        elif sync:
            # through text: the draft cache holds the tokenisation of exactly the committed text
            piece_t, piece_d = eng.model.token_to_piece, eng.draft_model.model.token_to_piece
            text_t = b"".join(piece_t(int(t), True) for t in committed if int(t) != eng.model.bos)
            text_d = b"".join(piece_d(int(t), True) for t in kv[len(eng.draft_model.backend.prefix):])
            # (an unfinished UTF-8 character at the very end waits for the next token)
            assert text_t.startswith(text_d) and len(text_t) - len(text_d) < 4
        n += 1
    return n


def run_checked(eng: LocalEngine, reqs, sync_every: int = 3):
    seqs = [eng.submit(r) for r in reqs]
    rounds = checked = 0
    while eng.scheduler.has_work():
        eng.step()
        rounds += 1
        checked += check_mirror(eng, sync=rounds % sync_every == 0)
    assert checked > 0
    return seqs


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(N_PROMPTS)


@pytest.fixture(scope="module")
def smol_baseline(smollm2, prompts):
    eng = engine(smollm2, "smollm2-135m", None)
    out = [s.generated for s in eng.run(requests(eng, prompts, ()))]
    eng.close()
    return out


def assert_lossless(eng, seqs, baseline, chain_name="draft", some_rejected=True):
    assert eng.runner.max_seqs_in_decode >= SLOTS  # the sequences really shared target batches
    for i, s in enumerate(seqs):
        assert s.generated == baseline[i], f"prompt {i} diverged"
    drafted = sum(s.spec_by_name[chain_name].drafted for s in seqs if chain_name in s.spec_by_name)
    accepted = sum(s.spec_by_name[chain_name].accepted for s in seqs if chain_name in s.spec_by_name)
    assert drafted > 0 and accepted > 0
    if some_rejected:
        assert accepted < drafted
    spec = eng.chain.speculator("draft")
    assert spec.counters.unsynced == 0  # process() kept the mirror: the history never had to be re-read
    assert spec.counters.failures == 0
    return drafted, accepted


def test_self_draft_is_lossless_and_batched(smollm2, prompts, smol_baseline):
    eng = engine(smollm2, "smollm2-135m", "smollm2-135m")
    assert eng.draft_model.mode == "same_vocab"
    seqs = run_checked(eng, requests(eng, prompts, ("draft",)))
    drafted, accepted = assert_lossless(eng, seqs, smol_baseline)
    spec = eng.chain.speculator("draft")
    # parallel drafting: a draft step decodes one row per drafting sequence, several sequences at a time
    assert spec.counters.steps < spec.counters.drafted_tokens / 2
    assert spec.counters.rolled_back > 0  # rejected tails left the draft cache
    print(f"\nself-draft: {accepted}/{drafted} accepted, {spec.counters}")
    eng.close()


def test_truncated_copy_draft_is_lossless(smollm2, prompts, smol_baseline):
    from specray.native.draft_truncate import truncated_copy

    path = truncated_copy("smollm2-135m", TRUNCATED_LAYERS)
    eng = engine(smollm2, "smollm2-135m", path, params={"draft": {"n_max": 4}})
    assert eng.draft_model.mode == "same_vocab" and eng.draft_model.mismatch is None
    seqs = run_checked(eng, requests(eng, prompts, ("draft",)))
    drafted, accepted = assert_lossless(eng, seqs, smol_baseline)
    print(f"\n20-layer copy: {accepted}/{drafted} accepted")
    eng.close()


def test_chain_with_ngram_and_cost_policy_is_lossless(smollm2, prompts, smol_baseline):
    # a draft step of the model itself costs a target step: drafting never pays, the price rules it out, and
    # only exploring drafts are made; with all of the round time allowed for exploring, they are frequent
    eng = engine(smollm2, "smollm2-135m", "smollm2-135m", policy="cost", model_explore=1.0)
    seqs = eng.run(requests(eng, prompts, ("ngram_mod", "draft")))
    for i, s in enumerate(seqs):
        assert s.generated == smol_baseline[i], f"prompt {i} diverged"
    # the priced chain ran the draft model and some of its drafts were verified
    assert eng.chain.speculator("draft").stats.drafts_chosen > 0
    eng.close()


def test_vocab_check_refuses_smollm2_for_gemma_naming_the_mismatch(gemma3):
    with pytest.raises(VocabMismatchError) as e:
        engine(gemma3, "gemma3-270m", "smollm2-135m")
    msg = str(e.value)
    assert e.value.mismatch.rule == "vocab_type"
    assert "vocab_type" in msg and "SPM" in msg and "BPE" in msg
    assert "smollm2-135m" in msg and "gemma3-270m" in msg and "--cross-vocab" in msg


def test_cross_vocab_smollm2_for_gemma_is_lossless(gemma3, prompts):
    base = engine(gemma3, "gemma3-270m", None)
    baseline = [s.generated for s in base.run(requests(base, prompts, ()))]
    base.close()
    eng = engine(gemma3, "gemma3-270m", "smollm2-135m", cross_vocab=True)
    assert eng.draft_model.mode == "cross_vocab"
    seqs = run_checked(eng, requests(eng, prompts, ("draft",)), sync_every=4)
    drafted, accepted = assert_lossless(eng, seqs, baseline)
    spec = eng.chain.speculator("draft")
    print(f"\ncross-vocab: {accepted}/{drafted} accepted, {spec.counters}")
    # the text mirror re-tokenises a tail window per round, not the whole text (the prompts alone are
    # ~100 tokens each, drafted and accepted text ~3 tokens per round)
    assert 0 < spec.counters.retokenised < 60 * spec.stats.calls
    assert spec.counters.translated_empty < spec.stats.calls
    eng.close()


def test_cli_generate_with_draft_model(capsys):
    from specray.cli.main import main

    rc = main(["generate", "--prompt", "Count from one to ten.", "--max-tokens", "24", "--spec", "draft",
               "--policy", "first", "--draft-model", "smollm2-135m", "--exact", "--n-ctx", "512"])
    assert rc == 0
    err = capsys.readouterr().err
    assert '"draft"' in err  # per-speculator stats of the request
    rc = main(["generate", "--prompt", "Hi", "--max-tokens", "4", "--spec", "draft", "--model", "gemma3-270m",
               "--draft-model", "smollm2-135m", "--n-ctx", "512"])
    assert rc == 2
    assert "vocab_type" in capsys.readouterr().err


def test_draft_without_a_draft_model_is_refused(smollm2):
    eng = engine(smollm2, "smollm2-135m", None)
    with pytest.raises(ValueError, match="needs a draft model"):
        eng.submit(eng.request(prompt="hi", chain=("draft",)))
    eng.close()


def test_a_slow_spell_does_not_become_the_draft_step_cost_shape(smollm2, monkeypatch):
    # Real draft decodes on a synthetic clock: n rows "take" 5 ms + 2 ms per extra row, 3x that
    # during a spell of the host; timed in pairs with a 1-row step, the shape survives the spell
    from specray.native import slot_backend
    from specray.native.context import Context
    from specray.native.draft_backend import LlamaDraftBackend

    ctx = Context(smollm2, n_ctx=1024, n_seq_max=4, n_batch=64, kv_unified=True)
    backend = LlamaDraftBackend(smollm2, ctx)
    clock = {"now": 0.0, "decodes": 0}
    real_decode = ctx.decode

    def timed_decode(batch=None):
        out = real_decode(batch)
        n = (batch or ctx.batch).n_tokens
        clock["now"] += (3.0 if 8 <= clock["decodes"] < 30 else 1.0) * (0.005 + 0.002 * (n - 1))
        clock["decodes"] += 1
        return out

    monkeypatch.setattr(ctx, "decode", timed_decode)
    monkeypatch.setattr(slot_backend.time, "perf_counter", lambda: clock["now"])
    try:
        table = backend.measure_decode_costs(sizes=(1, 2, 4, 8))
    finally:
        monkeypatch.undo()
        ctx.close()
    for n, secs in table.items():
        assert secs / table[1] == pytest.approx(1 + 0.4 * (n - 1), rel=1e-6), table
    assert backend.decode_costs() == table
