"""Attention tile pads on a real model (engine/tile_pads.py): rounds padded up to the CPU flash-attention
kernel's tile decode what the unpadded rounds decode, up to the two kernels' rounding (fast mode's near-ties),
and leave no pad cell behind; the start-up calibration prices the tile.

Conversations run turn by turn, several at once, all with one system prompt, as tests/integration/
test_prompt_cache.py runs them: a later turn's few dozen new prompt rows after a long cached history, beside the
other conversations' verify rows, is the round the pads are for.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.bench.run import classify_divergence, measure_batch_variance, measure_layout_variance
from specray.deployments.local_engine import LocalEngine
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest

from .test_prompt_cache import CHAIN, PARAMS, _chat, _conversations

pytestmark = pytest.mark.model


def _engine(model, tile_pads: bool, slots: int = 4, **kw) -> LocalEngine:
    cfg = EngineConfig(model="smollm2-135m", slots=slots, n_ctx=1024 * slots, record_margins=True,
                       tile_pads=tile_pads, flash_attn=True,
                       chain=ChainConfig(speculators=list(CHAIN), params=PARAMS, policy="first", n_max=8),
                       **{"calibrate": False} | kw)
    return LocalEngine(cfg, model=model)


def _pad_everywhere(engine: LocalEngine) -> None:
    """Price the tile nearly free and a few rows' attention dear, so that most rounds of fewer rows than the tile
    are padded: prompt chunks, verifies of drafts (whose rejected rows are rolled back besides) and plain decodes."""
    engine.scheduler.policy.cost = DecodeCostModel({1: 0.010, 8: 0.012, 32: 0.020, 64: 0.030}, attn_seconds=2e-5,
                                                   tile_attn_seconds=1e-9)
    engine.scheduler.tile_fit.ema = 0.0  # what the rounds measure would correct these prices: kept as they are


def test_the_cpu_flash_attention_context_has_a_tile_and_the_calibration_prices_it(smollm2):
    eng = _engine(smollm2, tile_pads=True, slots=2, calibrate=True)
    assert eng.ctx.attention_tile_rows == 64 and eng.scheduler.memory.attention_tile == 64
    cost = eng.scheduler.policy.cost
    # at a long context the tile is cheaper per row and cell than half as many rows taken one by one
    assert 0 < cost.tile_attn_seconds < cost.subtile_attn_seconds, (cost.tile_attn_seconds, cost.subtile_attn_seconds)
    eng.close()
    off = _engine(smollm2, tile_pads=False, slots=2, calibrate=True)  # no tile: not priced
    assert off.scheduler.memory.attention_tile == 0 and off.scheduler.policy.cost.tile_attn_seconds == 0
    off.close()


def test_a_context_of_one_sequence_id_prices_the_tile_in_phases(smollm2):
    # one slot, no branch ids: no second sequence to pair with; the prices come from measure_attention_cost's
    # phases, and the slot is left empty
    from specray.engine.target_calibration import measure_tile_attention_costs
    from specray.native.context import Context

    ctx = Context(smollm2, n_ctx=1024, n_seq_max=1, n_batch=512, flash_attn=True, n_threads=2)
    try:
        below, tile = measure_tile_attention_costs(ctx, ctx.attention_tile_rows)
        assert below > 0 and tile > 0, (below, tile)
        assert ctx.seq_pos_max(0) == -1
    finally:
        ctx.close()


def test_padded_rounds_diverge_only_at_near_ties_and_leave_no_cells(smollm2):
    convs = _conversations(4)
    on, off = _engine(smollm2, tile_pads=True), _engine(smollm2, tile_pads=False)
    _pad_everywhere(on)
    _pad_everywhere(off)  # the same prices (drafts and prefill order alike), no tile
    prefix = off.prompt_tokens(messages=[{"role": "user", "content": convs[0][0]}])
    tie_bound = 2.0 * max(measure_batch_variance(off, prefix), measure_layout_variance(off, prefix))
    b = _chat(off, convs)
    a = _chat(on, convs, answers=b)  # the same prompts: a divergence in one turn does not carry into the next
    stats = on.scheduler.stats
    assert stats.tile_pads >= 5 and stats.tile_pad_rows == on.runner.tile_pad_rows > 0, stats
    assert off.scheduler.stats.tile_pads == 0 and off.runner.tile_pad_rows == 0
    kinds = [classify_divergence(y.generated, x.generated, y.margins, tie_bound)
             for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    print(f"\ntile pads: {stats.tile_pads} rounds, {stats.tile_pad_rows} rows; tie bound {tie_bound:.3f}, "
          f"outcomes {kinds}")
    assert "mismatch" not in kinds
    assert sum(s.spec_total.accepted for seqs in a for s in seqs) > 0  # speculation was on
    # every idle slot holds in llama.cpp's cells exactly what the cache records: no pad cell stayed
    for slot, cached in on.scheduler.prefix_cache.idle.slots.items():
        assert on.ctx.seq_pos_max(slot) + 1 == len(cached.tokens)
    on.close(), off.close()


def test_a_padded_prefill_chunk_leaves_the_sequence_as_an_unpadded_one(smollm2):
    # a prompt prefilled in chunks of 40 rows (each padded to the tile on the sequence itself, at the positions
    # its next chunk then writes), then generated: the same tokens, the same cells
    prompt = (np.arange(800, dtype=np.int32) % 300) + 1000
    outs = []
    for pads in (True, False):
        eng = _engine(smollm2, tile_pads=pads, slots=1, prefill_chunk=40)
        _pad_everywhere(eng)
        seq = eng.run([GenerationRequest(prompt, max_tokens=16, chain=())])[0]
        assert eng.ctx.seq_pos_max(seq.slot) + 1 == seq.n_past
        assert (eng.scheduler.stats.tile_pads >= 10) == pads
        outs.append((seq.generated, seq.margins))
        eng.close()
    (got, _), (want, margins) = outs
    assert classify_divergence(want, got, margins, 1.0) != "mismatch"
