"""The prefix cache (engine/prefix_cache.py): multi-turn chats reuse their KV wherever it lives, and the output
does not change.

Conversations run turn by turn, several at once on several slots, speculation on, all with one system prompt
(as agents send): turn n's prompt is turn n-1's prompt, the answer and a new user message. One engine keeps
finished sequences' KV (the default), one does not; exact mode (batch-invariant target) must give
token-identical output, with the system prompt copied between slots (from running sequences too) and evicted
conversations restored from the host tier; fast mode (one KV pool, copies share cells) may diverge only at
near-ties. Prefill never stalls a conversation: short continuations go first, decoding streams keep going.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.bench.run import classify_divergence, measure_batch_variance, measure_layout_variance
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest, SeqState

from ..conftest import spec_bench_questions

pytestmark = pytest.mark.model

CHAIN = ("ngram_mod", "suffix")
PARAMS = {"ngram_mod": {"n_match": 3, "n_min": 1, "n_max": 8, "pool_size": 1 << 16},
          "suffix": {"min_match": 1, "p_min": 0.01}}
FOLLOW_UP = "Now say the same in two sentences."
# the agents' shared system prompt: long enough that a conversation waits for another's prefill of it and copies
SYSTEM = ("You are a careful assistant with tools. Rules: " + " ".join(
    f"{i}. Answer question kind {i} briefly, cite tool {i % 7}, and never invent a value for field f{i}."
    for i in range(1, 17)))


def _engine(model, exact: bool, prompt_cache: bool, slots: int = 4, **kw) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=1024 * slots, exact=exact, calibrate=False,
                       record_margins=True, prompt_cache=prompt_cache,
                       chain=ChainConfig(speculators=list(CHAIN), params=PARAMS, policy="first", n_max=8), **kw)
    return LocalEngine(cfg, model=model)


def _conversations(n: int) -> list[list[str]]:
    """n Spec-Bench multi-turn questions (two user turns each), plus a third turn."""
    multi = [q["turns"] for q in spec_bench_questions() if len(q.get("turns", ())) >= 2]
    return [list(t[:2]) + [FOLLOW_UP] for t in multi[:n]]


def _chat(engine: LocalEngine, convs: list[list[str]], max_tokens: int = 40, cache_prompt: bool = True,
          answers: list[list] | None = None):
    """Every conversation's turns, all conversations' turn t submitted together; returns [turn][conv] Sequence.
    `answers` ([turn][conv] Sequence of another run): its answers make the history, so both runs' prompts are the
    same even where their answers differ."""
    history: list[list[dict]] = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    turns = []
    for t in range(len(convs[0])):
        reqs = []
        for h, conv in zip(history, convs):
            h.append({"role": "user", "content": conv[t]})
            req = engine.request(messages=list(h), max_tokens=max_tokens)
            req.cache_prompt = cache_prompt
            reqs.append(req)
        seqs = engine.run(reqs)
        for c, (h, s) in enumerate(zip(history, seqs)):
            h.append({"role": "assistant", "content": (answers[t][c] if answers else s).text})
        turns.append(seqs)
    return turns


@pytest.fixture(scope="module")
def convs():
    return _conversations(4)


@pytest.fixture(scope="module")
def exact_without_cache(smollm2, convs):
    eng = _engine(smollm2, exact=True, prompt_cache=False)
    turns = _chat(eng, convs)
    assert eng.scheduler.prefix_cache.idle.stats()["hits"] == 0
    eng.close()
    return turns


def test_multi_turn_output_is_token_identical_with_the_cache_in_exact_mode(smollm2, convs, exact_without_cache):
    eng = _engine(smollm2, exact=True, prompt_cache=True)
    turns = _chat(eng, convs)
    system = len(eng.prompt_tokens(messages=[{"role": "system", "content": SYSTEM}]))
    assert system > 256 + 8  # longer than one prefill chunk: the first turns wait rounds for its prefill, then copy
    assert eng.runner.max_seqs_in_decode >= 4  # the conversations really shared batches
    for t, (with_cache, without) in enumerate(zip(turns, exact_without_cache)):
        for c, (a, b) in enumerate(zip(with_cache, without)):
            assert a.generated == b.generated, f"turn {t}, conversation {c} diverged with the prompt cache"
            assert b.cached_tokens == 0
            if t == 0:  # one conversation prefilled the system prompt, the others waited and copied it from its slot
                assert a.cached_tokens == 0 if c == 0 else a.cached_tokens >= system - 8, (c, a.cached_tokens)
            else:  # at least the whole previous prompt was found in the slot (it is a prefix of this one)
                prev = turns[t - 1][c]
                assert a.cached_tokens >= len(prev.req.prompt_tokens), (t, c, a.cached_tokens)
                assert a.cached_tokens < len(a.req.prompt_tokens)  # the last prompt token is always decoded
    assert sum(s.spec_total.accepted for seqs in turns for s in seqs) > 0  # speculation was on and paid
    stats = eng.scheduler.prefix_cache.stats()
    assert stats["hits"] == 11 and stats["reused_tokens"] == sum(s.cached_tokens for seqs in turns for s in seqs)
    assert stats["copies_from_running"] >= 3 and stats["waits"] >= 3
    # KV cells of idle slots are exactly what the cache records: nothing leaked, nothing lost
    kv = [eng.ctx.seq_pos_max(i) + 1 for i in range(4)]
    assert kv == [len(eng.scheduler.prefix_cache.idle.slots[i].tokens) for i in range(4)]
    eng.close()


def test_more_conversations_than_slots_and_opting_out(smollm2, convs, exact_without_cache):
    # 4 conversations on 2 slots: caches are evicted to the host tier and restored in turn; the output stays the same
    eng = _engine(smollm2, exact=True, prompt_cache=True, slots=2, cache_ram=256)
    turns = _chat(eng, convs)
    for t, (with_cache, without) in enumerate(zip(turns, exact_without_cache)):
        assert [s.generated for s in with_cache] == [s.generated for s in without], f"turn {t}"
    host = eng.scheduler.prefix_cache.stats()["host"]
    assert host["saves"] >= 2 and host["restores"] >= 2 and host["failed_restores"] == 0, host
    assert 0 < host["bytes"] <= 256 * 2**20 and host["entries"] == len(eng.runner.stashed)
    # a newer turn's save superseded its older one: that entry's buffer is kept for the next saves, and the
    # tier counts it against its budget (what the target reported after its last round)
    assert host["kept_bytes"] == eng.runner.ctx.recycled_bytes() > 0
    assert host["bytes"] + host["kept_bytes"] <= 256 * 2**20
    # a later turn found its whole history in host memory (its slot held another conversation meanwhile)
    assert all(s.cached_tokens >= len(p.req.prompt_tokens) for s, p in zip(turns[2], turns[1]))
    # a request that says cache_prompt: false prefills everything, even where its prefix is cached
    again = _chat(eng, convs[:2], cache_prompt=False)
    assert all(s.cached_tokens == 0 for seqs in again for s in seqs)
    assert [s.generated for s in again[0]] == [s.generated for s in exact_without_cache[0][:2]]
    eng.close()


def test_later_turns_continue_the_speculators_last_index_and_the_output_stays(smollm2, convs, exact_without_cache):
    # the n-gram speculators keep each finished turn's index (kept_states.py): a conversation's next turn starts
    # from it and indexes only its new tokens. Exact mode: the output is the target's alone, the reference's (an
    # engine without the prompt cache, on the same prompts)
    chain = ["ngram_mod", "suffix", "ngram_cache"]
    cfg = EngineConfig(model="smollm2-135m", slots=4, n_ctx=4096, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=chain, params=PARAMS, policy="first", n_max=8))
    eng = LocalEngine(cfg, model=smollm2)
    turns = _chat(eng, convs, answers=exact_without_cache)
    for t, (kept, without) in enumerate(zip(turns, exact_without_cache)):
        assert [s.generated for s in kept] == [s.generated for s in without], f"turn {t}"
    # every later turn (two of each of the four conversations) continued its last turn's trie and table: its
    # prompt starts with everything they had indexed, the last turn's prompt and nearly all of its answer
    later = [len(p.req.prompt_tokens) for seqs in turns[:2] for p in seqs]
    for name in ("suffix", "ngram_cache"):
        kept = eng.chain.speculator(name).kept
        assert kept.taken == 8, name
        assert sum(later) < kept.tokens_saved < sum(later) + sum(len(p.generated) for seqs in turns[:2] for p in seqs)
    assert sum(s.spec_total.accepted for seqs in turns for s in seqs) > 0
    eng.close()


def test_fast_mode_diverges_only_at_near_ties(smollm2, convs):
    on, off = (_engine(smollm2, exact=False, prompt_cache=pc) for pc in (True, False))
    prefix = off.prompt_tokens(messages=[{"role": "user", "content": convs[0][0]}])
    tie_bound = 2.0 * max(measure_batch_variance(off, prefix), measure_layout_variance(off, prefix))
    b = _chat(off, convs)
    a = _chat(on, convs, answers=b)  # the same prompts: a divergence in one turn does not carry into the next
    assert sum(s.cached_tokens for s in a[-1]) > 0
    kinds = [classify_divergence(y.generated, x.generated, y.margins, tie_bound)
             for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    print(f"\nprompt cache, fast mode: tie bound {tie_bound:.3f}, outcomes {kinds}")
    assert "mismatch" not in kinds
    on.close(), off.close()


def test_restores_share_the_system_prompt_in_one_kv_pool(smollm2, convs):
    # 4 conversations on 2 slots, one KV pool: a history restored from host memory sees the system prompt's cells
    # another slot holds instead of keeping its own copy of them; the output differs only at near-ties
    on, off = (_engine(smollm2, exact=False, prompt_cache=pc, slots=2, cache_ram=256) for pc in (True, False))
    prefix = off.prompt_tokens(messages=[{"role": "user", "content": convs[0][0]}])
    tie_bound = 2.0 * max(measure_batch_variance(off, prefix), measure_layout_variance(off, prefix))
    b = _chat(off, convs)
    a = _chat(on, convs, answers=b)
    stats = on.scheduler.prefix_cache.stats()
    assert stats["host"]["restores"] >= 2 and stats["shared_restores"] >= 1, stats
    kinds = [classify_divergence(y.generated, x.generated, y.margins, tie_bound)
             for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    print(f"\nshared restores {stats['shared_restores']}, tie bound {tie_bound:.3f}, outcomes {kinds}")
    assert "mismatch" not in kinds
    # every idle slot holds in llama.cpp's cells exactly what the cache records
    for slot, cached in on.scheduler.prefix_cache.idle.slots.items():
        assert on.ctx.seq_pos_max(slot) + 1 == len(cached.tokens)
        assert on.ctx.seq_pos_min(slot) == 0
    on.close(), off.close()


def test_idle_caches_give_way_to_new_sequences_in_one_kv_pool(smollm2):
    # 2 slots sharing 2048 cells: a cached conversation is evicted when a new request needs its cells
    eng = _engine(smollm2, exact=False, prompt_cache=True, slots=2)
    assert eng.scheduler.shared_cells == 2048
    first = eng.generate(prompt="Count: " + " ".join(str(i) for i in range(120)), max_tokens=8, chain=())
    cached = eng.scheduler.prefix_cache.idle.idle_cells()
    assert cached == first.n_past > 100 and eng.ctx.seq_pos_max(first.slot) + 1 == cached
    long_prompt = (np.arange(1900, dtype=np.int32) % 500) + 1000  # shares no prefix; leaves < `cached` cells free
    seq = eng.run([GenerationRequest(long_prompt, max_tokens=8, chain=())])[0]
    assert seq.slot != first.slot and seq.cached_tokens == 0 and len(seq.generated) == 8
    assert eng.scheduler.prefix_cache.idle.evicted == 1
    assert eng.ctx.seq_pos_max(first.slot) + 1 == 0  # the evicted cache's cells were freed
    eng.close()


def test_idle_caches_are_capped_by_their_price_with_flash_attention_off(smollm2):
    # one KV pool, flash attention off: every idle cell is computed (masked) by each decode; priced here so that
    # 150 idle cells cost the allowed 10% of a one-row decode, one 107-cell cache stays, two do not
    eng = _engine(smollm2, exact=False, prompt_cache=True, flash_attn=False)
    assert not eng.ctx.flash_attn and eng.scheduler.shared_cells is not None
    eng.scheduler.cost = DecodeCostModel({1: 0.006, 8: 0.012}, read_seconds=0.1 * 0.006 / 150)
    a, b, c = (eng.run([GenerationRequest(np.arange(100, dtype=np.int32) + base, max_tokens=8, chain=())])[0]
               for base in (1000, 2000, 3000))
    assert a.n_past == b.n_past == 107 and len({a.slot, b.slot, c.slot}) == 3
    # b decoded beside a's 107 idle cells (within the price); c beside a's and b's 214: the older, a's, went
    assert eng.scheduler.prefix_cache.idle.evicted == 1
    assert sorted(eng.scheduler.prefix_cache.idle.slots) == sorted([b.slot, c.slot])
    assert eng.ctx.seq_pos_max(a.slot) + 1 == 0
    eng.close()


def test_prefill_never_stalls_a_conversation(smollm2):
    # one stream decodes while a 1,500-token prompt prefills at 64 prompt rows a round; a short continuation
    # submitted meanwhile goes before the long prompt's rows and answers within a few rounds
    eng = _engine(smollm2, exact=False, prompt_cache=True, slots=3, prefill_budget=64)
    talker = eng.submit(GenerationRequest(np.arange(50, dtype=np.int32) + 1000, max_tokens=300, chain=()))
    eng.step()
    assert len(talker.generated) == 1
    long = eng.submit(GenerationRequest((np.arange(1500, dtype=np.int32) % 400) + 2000, max_tokens=4, chain=()))
    short = None
    rounds_to_first_token = None
    for r in range(1, 16):
        if r == 3:
            short = eng.submit(GenerationRequest(np.arange(40, dtype=np.int32) + 5000, max_tokens=4, chain=()))
        before = (len(talker.generated), long.n_prefilled)
        eng.step()
        assert len(talker.generated) == before[0] + 1, f"round {r}: the decoding stream stalled"
        assert long.n_prefilled > before[1] or long.state != SeqState.PREFILL, f"round {r}: the long prompt stalled"
        if short is not None and short.generated and rounds_to_first_token is None:
            rounds_to_first_token = r - 2
    assert long.state == SeqState.PREFILL  # still prefilling: 15 rounds of at most 64 rows
    assert rounds_to_first_token is not None and rounds_to_first_token <= 2, rounds_to_first_token
    eng.close()
