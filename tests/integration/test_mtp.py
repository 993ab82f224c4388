"""The `mtp` speculator co-located (in-process), on a synthetic glm4moe target with a NextN head.

Exact mode on the target: speculative greedy output must be token-identical to
plain decoding. The head is a noisy copy of the target's block, so about 40% of
its drafts are accepted and the rest rejected: the rows routed to it are
checked after accepted and rejected rounds alike, against the rows the target
computes for each sequence decoded alone. A clean copy of the block
(forced acceptance) proves the drafts are used: nearly all are accepted.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.deployments.local_engine import LocalEngine
from specray.deployments.replica.request import EngineRequest
from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig
from specray.engine.request import SeqState

from ..conftest import spec_bench_prompts
from ..hidden_models import mtp_target, solo_rows

pytestmark = pytest.mark.model

SLOTS = 4
N_PROMPTS = 6  # more than the slots: slots are reused by later sequences
MAX_TOKENS = 40
N_CTX = 512 * SLOTS


def engine(path: str, mtp: bool, n_max: int = 4, n_batch: int = 512) -> LocalEngine:
    cfg = EngineConfig(model=path, slots=SLOTS, n_ctx=N_CTX, exact=True, calibrate=False, n_batch=n_batch,
                       chain=ChainConfig(speculators=[], policy="first", n_max=8,
                                         params={"mtp": {"n_max": n_max, "audit": True}}),
                       hidden=HiddenStateConfig(mtp=mtp))
    return LocalEngine(cfg)


def requests(eng, prompts, chain):
    return [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                        ignore_eos=True) for p in prompts]


@pytest.fixture(scope="module")
def prompts():
    return spec_bench_prompts(N_PROMPTS)


@pytest.fixture(scope="module")
def baseline(prompts):
    """Plain greedy decoding per target file (the heads do not change the target's output)."""
    out = {}
    for head in ("noisy", "copy"):
        eng = engine(mtp_target(head), mtp=False)
        out[head] = [s.generated for s in eng.run(requests(eng, prompts, ()))]
        eng.close()
    return out


def check_rows(eng, solo: list, prompt_of: dict) -> int:
    """Rows the head received for every decoding sequence: its own, position by position, bitwise equal to
    the target's rows for that sequence decoded alone. Returns the rows checked."""
    spec = eng.chain.speculator("mtp")
    n = 0
    for slot, seq in eng.scheduler.active.items():
        if seq.state != SeqState.DECODING:
            continue
        hist = seq.history_view()[: seq.n_past]  # what the target committed
        audit = spec.audit[slot]
        assert sorted(audit) == list(range(seq.n_past)), f"slot {slot}: rows for positions {sorted(audit)[-3:]}..."
        want = solo[prompt_of[seq.id]]
        for pos in range(seq.n_past):
            tok, row = audit[pos]
            assert tok == hist[pos]
            assert np.array_equal(row, want[pos]), f"slot {slot} position {pos}: not this sequence's row"
        assert spec.committed(slot).tolist() == hist.tolist()
        # the head's KV: committed pairs (+ the last draft's seed), never a drafted pair
        kv = spec.kv_tokens(slot)
        assert eng.hidden_heads.named()["mtp"].pos_max(slot) + 1 == len(kv) <= seq.n_past + 1
        assert kv[: seq.n_past].tolist() == hist[: len(kv)].tolist()
        n += seq.n_past
    return n


def test_mtp_lossless_with_rows_routed_per_sequence(prompts, baseline):
    path = mtp_target("noisy")
    eng = engine(path, mtp=True, n_batch=64)  # small batches: prompts arrive in several chunks
    try:
        reqs = requests(eng, prompts, ("mtp",))
        seqs = [eng.submit(r) for r in reqs]
        prompt_of = {s.id: i for i, s in enumerate(seqs)}
        taps = eng.runner.hidden_out.taps
        solo = solo_rows(eng.model, taps, [np.concatenate([r.prompt_tokens, baseline["noisy"][i]])
                                           for i, r in enumerate(reqs)], n_ctx=N_CTX, slots=SLOTS)
        checked = 0
        while eng.scheduler.has_work():
            eng.step()
            checked += check_rows(eng, solo, prompt_of)
        assert checked > 0
        assert [s.generated for s in seqs] == baseline["noisy"]
        assert eng.runner.max_seqs_in_decode >= SLOTS
        assert max(len(r.prompt_tokens) for r in reqs) > 2 * 64  # a prompt committed in 3+ chunks
        spec = eng.chain.speculator("mtp")
        st = spec.stats
        assert 0 < st.tokens_accepted < st.tokens_generated  # accepted and rejected rounds both happened
        c = spec.counters
        assert c.mismatched == c.unsynced == c.lost == c.failures == 0
        # rows: exactly the committed tokens (prompt + generated but the last), nothing for rejected drafts
        assert eng.runner.hidden_rows == sum(len(r.prompt_tokens) + MAX_TOKENS - 1 for r in reqs)
        print(f"\nmtp (noisy head): {st.tokens_accepted}/{st.tokens_generated} accepted, counters {c}")
    finally:
        eng.close()


def test_forced_acceptance_drafts_are_used(prompts, baseline):
    """A head that copies the target's block: its drafts are the target's tokens, and the stats show it."""
    eng = engine(mtp_target("copy"), mtp=True, n_max=4)
    try:
        seqs = eng.run(requests(eng, prompts, ("mtp",)))
        assert [s.generated for s in seqs] == baseline["copy"]
        st = eng.chain.speculator("mtp").stats
        assert st.tokens_generated > 0 and st.acceptance_rate > 0.9
        assert st.mean_acceptance_length > 3.5  # of at most 1 + n_max = 5
        assert all(s.spec_by_name["mtp"].accepted > 0 for s in seqs)
        # fewer target rounds than tokens: each round emits ~4 tokens per sequence
        assert sum(s.rounds for s in seqs) < 0.4 * sum(len(s.generated) for s in seqs)
        print(f"\nmtp (copied head): acceptance {st.acceptance_rate:.3f}, mean length {st.mean_acceptance_length:.2f}")
    finally:
        eng.close()


def test_no_hidden_rows_for_sequences_without_a_hidden_speculator(prompts, baseline):
    """MTP configured, but requests that do not use it: the taps stay off and the target returns no rows."""
    eng = engine(mtp_target("noisy"), mtp=True)
    try:
        seqs = eng.run(requests(eng, prompts[:SLOTS], ("ngram_mod",)) + requests(eng, prompts[:1], ()))
        assert [s.generated for s in seqs[:SLOTS]] == baseline["noisy"][:SLOTS]
        assert eng.runner.hidden_rows == 0 and eng.runner.hidden_out.switches == 0
        assert eng.chain.speculator("mtp").counters.records == 0
    finally:
        eng.close()


def test_colocated_router_runs_mtp_in_process(prompts, baseline):
    """RouterCore in co-located mode (the `colocated` app's replica): the MTP head next to the target, rows
    handed over in-process."""
    import asyncio

    from specray.deployments.replica.core import RouterCore, next_chunk
    from specray.deployments.config import ServeConfig

    engine = {"model": mtp_target("copy"), "n_ctx": N_CTX, "slots": SLOTS, "exact": True, "calibrate": False,
              "hidden": {"mtp": True}, "chain": {"speculators": ["mtp"], "policy": "first", "n_max": 4}}
    core = RouterCore(ServeConfig.model_validate({"mode": "colocated", "engine": engine}))
    try:
        assert core.hidden_heads is not None and core.runner.hidden_out is not None

        async def one(p):
            req = core.make_request(EngineRequest(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                                                  ignore_eos=True))
            seq, q = await core.submit(req)
            while True:
                _, term = await next_chunk(q)
                if term:
                    return seq, term

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts[:SLOTS]))

        done = asyncio.run(main())
        assert [s.generated for s, _ in done] == baseline["copy"][:SLOTS]
        by = [t.speculative["by_speculator"]["mtp"] for _, t in done]
        assert sum(b["accepted_tokens"] for b in by) > 0.9 * sum(b["drafted_tokens"] for b in by) > 0
    finally:
        core.close()


def test_the_prompt_cache_is_not_used_by_mtp_sequences(prompts, baseline):
    # the head needs the target's hidden row of every prompt token, which a reused prefix never produces: an mtp
    # sequence prefills its whole prompt; a plain one on the same slots reuses the cached KV
    eng = engine(mtp_target("noisy"), mtp=True)
    try:
        eng.run(requests(eng, prompts[:SLOTS], ("mtp",)))
        again = eng.run(requests(eng, prompts[:SLOTS], ("mtp",)))
        assert [s.cached_tokens for s in again] == [0] * SLOTS
        assert [s.generated for s in again] == baseline["noisy"][:SLOTS]
        plain = eng.run(requests(eng, prompts[:SLOTS], ()))
        assert all(s.cached_tokens == len(s.req.prompt_tokens) - 1 for s in plain)
        assert [s.generated for s in plain] == baseline["noisy"][:SLOTS]
        c = eng.chain.speculator("mtp").counters
        assert c.mismatched == c.unsynced == c.lost == c.failures == 0
    finally:
        eng.close()
