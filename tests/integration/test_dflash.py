"""The `dflash` speculator co-located: SmolLM2-135M as the target, synthetic DFlash / DFlash2 drafts for it.

The drafts have random weights, so their blocks are (almost) never accepted:
the tests are about losslessness and plumbing. Exact mode; the three layer
inputs (layers 1, 15, 27) the target hands the draft are checked against the
rows of each sequence decoded alone, and after every round the draft's cache
must hold exactly the window's positions (no block cell left behind). The
last test shifts a real draft cache (llama.cpp's seq_add re-ropes the keys)
and checks that the next block drafts what a cache built at the new positions
drafts.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig, HiddenStateConfig
from specray.engine.request import SeqState
from specray.native import ext
from specray.native.gguf_meta import dflash_target_layers
from specray.native.model import Model

from ..conftest import spec_bench_prompts
from ..hidden_models import dflash_draft, solo_rows

pytestmark = pytest.mark.model

N_PROMPTS = 4
MAX_TOKENS = 16
LAYERS = (1, 15, 27)
_BASE: dict[int, list] = {}


def engine(model, slots: int, path: str | None) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=512 * slots, exact=True, calibrate=False,
                       chain=ChainConfig(speculators=[], policy="first", n_max=8,
                                         params={"dflash": {"n_max": 6, "audit": True}}),
                       hidden=HiddenStateConfig(dflash_model=path))
    return LocalEngine(cfg, model=model)


def requests(eng, prompts, chain):
    return [eng.request(messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, chain=chain,
                        ignore_eos=True) for p in prompts]


def baseline(model, slots: int) -> list:
    if slots not in _BASE:
        eng = engine(model, slots, None)
        _BASE[slots] = [s.generated for s in eng.run(requests(eng, spec_bench_prompts(N_PROMPTS), ()))]
        eng.close()
    return _BASE[slots]


def test_dflash_drafts_load_and_declare_what_they_read():
    for kind, top_k in (("dflash", 0), ("dflash2", 4)):
        path = dflash_draft(kind)
        assert dflash_target_layers(path) == LAYERS
        m = Model(path)
        try:
            assert ext.target_layer_ids(m.ptr) == LAYERS and m.n_embd == 576
            assert ext.llama_model_dflash_selector_top_k(m.ptr) == top_k
        finally:
            m.close()


def test_a_block_drafts_from_the_rows_after_its_anchor(smollm2):
    """Draft k of a block is the output of block token k + 1 (a mask after the anchor). Asked for the outputs of
    tokens 1..n only, this llama.cpp handed back those of tokens 0..n-1: every draft a position early."""
    from specray.native.dflash_backend import DFlashHead

    head = DFlashHead(dflash_draft(), smollm2, slots=1, n_ctx=512, calibrate=False)
    try:
        rows = np.random.default_rng(0).standard_normal((20, head.width)).astype(np.float32)
        head.inject([(0, 0, rows)])
        n = 7
        (toks, _), = head.draft_blocks([(0, 20, 123, n)])
        head.kv_remove(0, 20)
        block = np.full(n + 1, head.mask, dtype=np.int32)
        block[0] = 123
        head.batch.clear()
        head.batch.add_tokens(0, block, 20, first_output=0)
        head.batch.process()
        every = head.ctx.logits(n + 1).argmax(axis=1)
        assert toks.tolist() == every[1:].tolist() and toks.tolist() != every[:-1].tolist()
    finally:
        head.close()
        head.model.close()


@pytest.mark.parametrize("slots,kind", [(1, "dflash"), (4, "dflash"), (4, "dflash2")])
def test_dflash_lossless_rows_routed_and_window_kept(smollm2, slots, kind):
    prompts = spec_bench_prompts(N_PROMPTS)
    base = baseline(smollm2, slots)
    eng = engine(smollm2, slots, dflash_draft(kind))
    try:
        head = eng.hidden_heads.named()["dflash"]
        assert head.taps == LAYERS and eng.runner.hidden_out.tap_widths == (576, 576, 576)
        assert head.block_size == 8 and head.top_k == (4 if kind == "dflash2" else 0)
        reqs = requests(eng, prompts, ("dflash",))
        seqs = [eng.submit(r) for r in reqs]
        solo = solo_rows(smollm2, LAYERS, [np.concatenate([r.prompt_tokens, base[i]]) for i, r in enumerate(reqs)],
                         n_ctx=512 * slots, slots=slots)
        index = {s.id: i for i, s in enumerate(seqs)}
        spec = eng.chain.speculator("dflash")
        checked = 0
        while eng.scheduler.has_work():
            eng.step()
            for slot, seq in eng.scheduler.active.items():
                if seq.state != SeqState.DECODING:
                    continue
                audit, want, hist = spec.audit[slot], solo[index[seq.id]], seq.history_view()
                assert sorted(audit) == list(range(seq.n_past))
                for pos in (0, seq.n_past // 2, seq.n_past - 1):
                    assert audit[pos][0] == hist[pos] and np.array_equal(audit[pos][1], want[pos])
                w = spec.seqs[slot].window
                assert w.lo == 0 and w.end == seq.n_past and w.injected <= seq.n_past
                # the cache holds the injected rows and nothing else: the blocks' cells left after each draft
                assert head.pos_max(slot) == w.injected - 1
                assert spec.kv_tokens(slot).tolist() == hist[: w.injected].tolist()
                checked += 1
        assert checked > 0
        assert [s.generated for s in seqs] == base
        st, c = spec.stats, spec.counters
        assert st.tokens_generated > 0 and c.blocks > 0 and c.injected_rows > 0
        assert c.mismatched == c.unsynced == c.lost == c.failures == 0
        if slots > 1:
            assert eng.runner.max_seqs_in_decode >= slots
            assert c.blocks < st.drafts_chosen  # blocks of several slots shared a decode
        drafted = [t for s in seqs for t in s.generated]
        assert len(set(drafted)) > 1
        print(f"\n{kind} x{slots}: {st.tokens_accepted}/{st.tokens_generated} accepted (random draft), {c}")
    finally:
        eng.close()


def test_context_shift_of_a_real_draft_cache(smollm2):
    """shift(): rows 0..3 stay, 4..13 leave, 14..19 move to 4..9 (seq_add); the next block then drafts what a
    cache written at those positions from scratch drafts."""
    from specray.native.dflash_backend import DFlashHead

    head = DFlashHead(dflash_draft(), smollm2, slots=2, n_ctx=512, n_batch=64, calibrate=False)
    try:
        rows = np.random.default_rng(3).standard_normal((20, head.width)).astype(np.float32)
        toks = np.arange(100, 120, dtype=np.int32)
        spec = head.speculator()
        from specray.engine.hidden_rows import pack_rows
        from specray.engine.speculator import DraftRequest

        spec.begin(0, toks)
        spec.take_hidden(pack_rows(1, LAYERS, (576,) * 3, [(0, 0, toks, rows)]))
        spec.process(0, toks, 0)
        spec.draft([DraftRequest(0, np.append(toks, 7), 4)])
        assert head.pos_max(0) == 19
        spec.shift(0, 4, 10)
        assert head.pos_max(0) == 9 and spec.seqs[0].window.end == 10
        kept = np.r_[0:4, 14:20]
        head.inject([(1, 0, rows[kept])])
        a = head.draft_blocks([(0, 10, 7, 6)])[0][0]
        head.kv_remove(0, 10)
        b = head.draft_blocks([(1, 10, 7, 6)])[0][0]
        assert a.tolist() == b.tolist()
    finally:
        head.close()


def test_calibrated_costs_and_the_cost_policy(smollm2):
    """Measured block and injection costs (the calibration leaves no cell behind), and a run under the cost
    policy, which prices a dflash draft as one injection + one block decode: output unchanged."""
    base = baseline(smollm2, 1)
    cfg = EngineConfig(model="smollm2-135m", slots=1, n_ctx=512, exact=True, calibrate=True,
                       chain=ChainConfig(speculators=[], policy="cost", n_max=8),
                       hidden=HiddenStateConfig(dflash_model=dflash_draft()))
    eng = LocalEngine(cfg, model=smollm2)
    try:
        head = eng.hidden_heads.named()["dflash"]
        block, inject = head.decode_costs(), head.inject_costs()
        assert {1, 2, 8} <= set(block) and {1, 8, 64} <= set(inject)
        assert all(v > 0 for v in (*block.values(), *inject.values()))
        assert head.pos_max(0) == -1
        spec = eng.chain.speculator("dflash")
        assert spec.step_cost.table() and spec.draft_seconds(1, 7) >= spec.draft_seconds(1, 1) > 0
        seqs = eng.run(requests(eng, spec_bench_prompts(N_PROMPTS), ("dflash",)))
        assert [s.generated for s in seqs] == base
    finally:
        eng.close()
