"""Look-up speculators index a prompt as the target prefills it (Speculator.prefilling), a chunk a round, not all
in the round that admits it: their drafts and tables are those of the prompt indexed at once, a kept index is not
counted again, and the scheduler tells them each round's chunk (with overlapped rounds, inside the decode).

The real model's lossless runs go through this path too (tests/integration/test_lossless.py, test_overlap.py)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest
from specray.engine.scheduler import Scheduler
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.ngram_cache import NgramCacheParams, NgramCacheSpeculator
from specray.engine.speculators.registry import speculator_factory
from specray.engine.speculators.suffix import SuffixParams, SuffixSpeculator

from .standin_target import LaunchedTarget, Tok

SPECS = {
    "suffix": lambda **kw: SuffixSpeculator(SuffixParams(global_work_per_call=0, **kw)),
    "ngram_cache": lambda **kw: NgramCacheSpeculator(NgramCacheParams(**kw)),
}


def _text(seed: int, n: int) -> np.ndarray:
    """Tokens with repeats (pieces of a small vocabulary's phrases), so the tables have something to draft."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 60, rng.integers(3, 12)) for _ in range(15)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[rng.integers(len(phrases))].tolist() if rng.random() < 0.8 else [int(rng.integers(0, 60))]
    return np.array(out[:n], np.int32)


def _drafts(spec, seq_id: int, prompt: np.ndarray, generated: np.ndarray) -> list[list[int]]:
    h = prompt.tolist()
    out = []
    for t in generated.tolist():
        out.append(spec.draft([DraftRequest(seq_id, np.array(h, np.int32), 8)])[0].tolist())
        h.append(t)
    return out


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_a_prompt_indexed_a_chunk_at_a_time_drafts_as_one_indexed_at_once(name, chunk):
    for seed in range(3):
        chunked, at_once = SPECS[name](), SPECS[name]()
        # two sequences after each other: the second drafts from what the first left behind (global trie,
        # dynamic table), which must be the same too
        for seq_id, (n_prompt, n_gen) in enumerate([(300, 80), (150, 60)]):
            text = _text(seed * 10 + seq_id, n_prompt + n_gen)
            prompt, generated = text[:n_prompt], text[n_prompt:]
            chunked.begin(seq_id, prompt)
            at_once.begin(seq_id, prompt)
            assert chunked.indexed(seq_id) == 0  # begin indexes nothing: the prefill's rounds do
            for n in range(chunk, n_prompt + chunk, chunk):
                chunked.prefilling(seq_id, min(n, n_prompt))
                assert chunked.indexed(seq_id) == min(n, n_prompt)
            at_once.prefilling(seq_id, n_prompt)
            assert _drafts(chunked, seq_id, prompt, generated) == _drafts(at_once, seq_id, prompt, generated)
            chunked.end(seq_id)
            at_once.end(seq_id)
    if name == "suffix":
        chunked.flush_global()
        at_once.flush_global()
        assert chunked.get_state() == at_once.get_state()
    else:
        assert chunked.get_state() == at_once.get_state()  # the dynamic table, with the kept tables merged in


@pytest.mark.parametrize("name", list(SPECS))
def test_a_sequence_that_drafts_before_its_prompt_is_indexed_indexes_the_rest_then(name):
    text = _text(5, 260)
    prompt, generated = text[:200], text[200:]
    lazy, at_once = SPECS[name](), SPECS[name]()
    lazy.begin(0, prompt)
    lazy.prefilling(0, 50)  # a prefill cut short of its prompt (a chain changed mid-prefill, or no prefill at all)
    at_once.begin(0, prompt)
    at_once.prefilling(0, 200)
    assert _drafts(lazy, 0, prompt, generated) == _drafts(at_once, 0, prompt, generated)
    assert lazy.indexed(0) == 259


@pytest.mark.parametrize("name", list(SPECS))
def test_a_continued_conversation_is_not_counted_again_by_its_prefill(name):
    text = _text(7, 400)
    # no dynamic table: a kept table reaches it later than a merged one, which changes what it drafts from
    kw = {"update_dynamic": False} if name == "ngram_cache" else {}
    spec, fresh = SPECS[name](**kw), SPECS[name](keep_finished=0, **kw)
    for s in (spec, fresh):
        s.begin(0, text[:150])
        s.prefilling(0, 150)
        _drafts(s, 0, text[:150], text[150:200])
        s.end(0)
    spec.begin(1, text[:300])  # the next turn: it starts with everything the first one indexed (199 tokens)
    fresh.begin(1, text[:300])
    assert spec.stats.continued == 1 and spec.indexed(1) == 199
    for n in (64, 128, 192, 256, 300):  # chunks that end inside the kept history leave it as it is
        spec.prefilling(1, n)
        fresh.prefilling(1, n)
        assert spec.indexed(1) == max(199, n) and fresh.indexed(1) == n
    assert _drafts(spec, 1, text[:300], text[300:]) == _drafts(fresh, 1, text[:300], text[300:])


# ---- the scheduler: each round's prompt chunk reaches the speculators ----------------------------------------


class LoggedSuffix(SuffixSpeculator):
    def __init__(self, params, log: list, fail: bool = False) -> None:
        super().__init__(params)
        self.log, self.fail = log, fail

    def _prefilling(self, seq_id: int, n: int) -> None:
        self.log.append(("prefilling", seq_id, n))
        if self.fail:
            raise RuntimeError("index broke")
        super()._prefilling(seq_id, n)


def _scheduler(log: list, overlap: bool = False, fail: bool = False) -> Scheduler:
    names = ["suffix", "ngram_cache"]
    config = EngineConfig(slots=2, calibrate=False, chain=ChainConfig(speculators=names), cache_ram=0,
                          prompt_cache=False, prefill_chunk=32, n_batch=64)
    chain = Chain(config.chain, speculator_factory({"suffix": lambda p: LoggedSuffix(p, log, fail)}))
    s = Scheduler(config, LaunchedTarget(log), Tok(), chain, n_ctx=4096)
    if overlap:
        s.use_overlap(decode_blocks=False)  # the launch returns at once, as a GPU's: the work sits in the decode
    return s


def test_each_rounds_prompt_chunk_is_indexed_in_that_round():
    log: list = []
    s = _scheduler(log)
    short = s.submit(GenerationRequest(np.arange(100, 120, dtype=np.int32), max_tokens=30))
    s.step()  # the short prompt (20 rows) in one round; it decodes from the next
    long = s.submit(GenerationRequest(_text(1, 150), max_tokens=3))
    seen = []
    while long.n_prefilled < 150:
        s.step()
        seen.append(long.n_prefilled)
        for name in ("suffix", "ngram_cache"):  # every row the target holds is indexed, and no more
            assert s.chain.speculator(name).indexed(long.slot) == long.n_prefilled
    assert seen[-1] == 150 and len(seen) >= 4  # the prefill took several rounds, beside the short one decoding
    # each prefilling call came before the decode of the chunk it names
    for i, e in enumerate(log):
        if e[0] == "prefilling" and e[1] == long.slot:
            assert log[i + 1][0] == "prefilling" or log[i + 1][0] == "launch"
    while s.has_work():
        s.step()
    assert long.generated == [5, 5, 5] and short.finished


def test_with_overlapped_rounds_a_chunk_is_indexed_inside_its_decode():
    log: list = []
    s = _scheduler(log, overlap=True)
    seq = s.submit(GenerationRequest(_text(2, 100), max_tokens=2))
    while s.has_work():
        s.step()
    calls = [i for i, e in enumerate(log) if e[0] == "prefilling"]
    assert [log[i][2] for i in calls] == [32, 64, 96, 100]
    for i in calls:  # between the launch of the round that prefills the chunk and its collect
        last = max(j for j in range(i) if log[j][0] in ("launch", "collect"))
        assert log[last][0] == "launch", log
    assert seq.generated == [5, 5]


def test_a_speculator_that_fails_indexing_leaves_the_sequence_decoding_without_speculation():
    log: list = []
    s = _scheduler(log, fail=True)
    seq = s.submit(GenerationRequest(_text(3, 80), max_tokens=4))
    while s.has_work():
        s.step()
    assert [e for e in log if e[0] == "prefilling"] == [("prefilling", seq.slot, 32)]  # then no more asked
    assert seq.chain == () and seq.generated == [5, 5, 5, 5] and seq.error is None


def test_doctests():
    from specray.engine import speculator

    failed, attempted = doctest.testmod(speculator)
    assert attempted and not failed
