"""Attention tile pads (engine/tile_pads.py): which rounds are padded up to the target's attention tile, on which
sequence, and how the scheduler hands the pads to the target. The scheduler runs on a stand-in target that
records its rounds; tests/integration/test_tile_pads.py decodes padded rounds on a real model."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.engine import tile_pads
from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.cost import DecodeCostModel
from specray.engine.draft_tree import DraftTree
from specray.engine.request import GenerationRequest
from specray.engine.rollback import TargetMemory
from specray.engine.scheduler import Scheduler
from specray.engine.speculators.registry import speculator_factory
from specray.engine.target import StepItem, StepOutput, StepResult
from specray.engine.tile_pads import KernelFit, round_prices, tile_pad

# the shape measured on a 2-core CPU with SmolLM2: a few-row decode pays about 3x the tile's price per row x cell
COST = dict(attn_seconds=6e-6, tile_attn_seconds=2e-6)


def _cost(**kw) -> DecodeCostModel:
    return DecodeCostModel({1: 0.010, 8: 0.030, 32: 0.100}, **(COST | kw))


def _prefill(seq_id: int, rows: int, pos0: int, **kw) -> StepItem:
    return StepItem(seq_id, np.full(rows, 7, np.int32), pos0, sample=False, **kw)


def _verify(seq_id: int, pos0: int, n_draft: int = 1, **kw) -> StepItem:
    return StepItem(seq_id, np.full(1 + n_draft, 7, np.int32), pos0, n_draft=n_draft, **kw)


def test_doctests():
    assert doctest.testmod(tile_pads).failed == 0


def test_a_later_turn_beside_verifies_at_a_long_context_is_padded_on_the_prefilling_sequence():
    items = [_verify(0, 1750), _prefill(1, 48, 1700), _verify(2, 1750)]
    room = {0: 100, 1: 100, 2: 100}
    assert tile_pad(items, room, 2200, 64, _cost())[0] == (1, 64 - 52)


def test_short_contexts_and_few_rows_are_not_padded():
    room = {0: 500, 1: 500}
    # the same rows at a short context: the pads' weights work is not paid back
    assert tile_pad([_prefill(0, 48, 100), _verify(1, 120)], room, 270, 64, _cost())[0] is None
    # a few verify rows at a long context: 64 rows cost far more than 4
    assert tile_pad([_verify(0, 1750), _verify(1, 1750)], room, 1800, 64, _cost())[0] is None


def test_a_round_at_or_above_the_tile_or_without_a_tile_price_is_left_alone():
    room = {0: 500}
    assert tile_pad([_prefill(0, 64, 1700)], room, 1764, 64, _cost())[0] is None
    assert tile_pad([_prefill(0, 200, 1700)], room, 1900, 64, _cost())[0] is None
    assert tile_pad([_prefill(0, 48, 1700)], room, 1748, 64, _cost(tile_attn_seconds=0.0))[0] is None


def test_the_union_of_cells_decides_many_sequences_with_contexts_of_their_own_are_not_padded():
    # four conversations of 1,750 tokens each, nothing shared: the tile computes every row over all 7,000 cells
    items = [_prefill(0, 40, 1700), _verify(1, 1750), _verify(2, 1750), _verify(3, 1750)]
    room = {s: 100 for s in range(4)}
    assert tile_pad(items, room, 7000, 64, _cost())[0] is None
    assert tile_pad(items, room, None, 64, _cost())[0] is None  # not known: each sequence counted whole
    # the same rows sharing a 1,600-token system prompt
    assert tile_pad(items, room, 1600 + 4 * 150 + 46, 64, _cost())[0] == (0, 18)


def test_the_pads_need_room_and_a_plain_carrier():
    long = _prefill(0, 40, 1700)
    other = _verify(1, 1750)
    assert tile_pad([long, other], {0: 21, 1: 0}, 1800, 64, _cost())[0] is None  # 22 pad rows, room for 21
    assert tile_pad([long, other], {0: 0, 1: 22}, 1800, 64, _cost())[0] == (1, 22)  # the other one carries them
    tree = DraftTree.build([5], [(0, [6])])
    for odd in (_verify(1, 1750, n_draft=2, tree=tree), _verify(1, 1750, n_replay=1), _verify(1, 1750, hidden=True),
                _verify(1, 1750, shift=(10, 5))):
        assert tile_pad([long, odd], {0: 0, 1: 100}, 1800, 64, _cost())[0] is None


def test_the_below_tile_price_measured_at_a_long_context_is_preferred():
    items = [_verify(0, 1750), _prefill(1, 40, 1700)]
    room = {0: 100, 1: 100}
    # the few-row price of a short context says the pads do not pay; the one measured beside the tile's says so
    assert tile_pad(items, room, 1800, 64, _cost(attn_seconds=2e-6))[0] is None
    assert tile_pad(items, room, 1800, 64, _cost(attn_seconds=2e-6, subtile_attn_seconds=6e-6))[0] == (1, 22)


def test_rounds_are_quoted_for_the_kernel_they_run_and_what_they_measure_corrects_the_prices():
    cost = _cost(attn_seconds=4e-6)
    room = {0: 100, 1: 100}
    below = [_verify(0, 1750), _prefill(1, 34, 1700)]  # 36 rows: priced dearer padded at the start-up slopes
    pad, quote = tile_pad(below, room, 1800, 64, cost)
    assert pad is None and not quote.tiled and quote.seconds > 0
    _, on_tile = tile_pad([_prefill(1, 100, 1700)], room, 1800, 64, cost)
    assert on_tile.tiled  # a round on the tile anyway teaches the tile's price
    assert tile_pad([_prefill(1, 40, 10)], room, 60, 64, cost) == (None, None)  # a short context: nothing
    assert tile_pad([_prefill(1, 300, 1700)], room, 2000, 64, cost) == (None, None)  # twice the tile or more
    fit = KernelFit()
    for _ in range(30):  # the below-tile kernel measures half again its quote at these contexts
        fit.observe(quote, 1.5 * quote.seconds)
    pad, padded_quote = tile_pad(below, room, 1800, 64, cost, fit)
    assert pad == (1, 28) and padded_quote.tiled


def test_the_prices_follow_the_machines_speed():
    cost = _cost()
    before = round_prices(48, 48 * 1724.0, 1800, 64, cost)
    for _ in range(60):
        cost.observe(1, 0.020)  # the machine got twice as slow
    after = round_prices(48, 48 * 1724.0, 1800, 64, cost)
    assert after[0] == pytest.approx(2 * before[0], rel=0.05) and after[1] == pytest.approx(2 * before[1], rel=0.05)


class RecordingTarget:
    """Emits token 5 for every sampled row and keeps each round's items."""

    def __init__(self) -> None:
        self.rounds: list[list[StepItem]] = []

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        pass

    def release(self, seq_id, keep=0):
        pass

    def step(self, items):
        self.rounds.append(items)
        results = [StepResult(it.seq_id, np.array([5] if it.sample else [], np.int32)) for it in items]
        rows = sum(len(it.tokens) + it.tile_pad for it in items)
        return StepOutput(results, 0.5, rows, 1, [rows])  # every decode takes half a second


class Tok:
    def token_to_piece(self, token, special=False):
        return b"x"

    def is_eog(self, token):
        return False


def _scheduler(target: RecordingTarget, tile: int, **cfg) -> Scheduler:
    chain = ChainConfig(speculators=[])
    config = EngineConfig(slots=2, calibrate=False, chain=chain, cache_ram=0, **cfg)
    return Scheduler(config, target, Tok(), Chain(chain, speculator_factory()), n_ctx=4096, cost=_cost(),
                     shared_cells=4096, memory=TargetMemory(attention_tile=tile))


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 1000, n).astype(np.int32)


def _next_turn_round(tile: int, **cfg) -> tuple[Scheduler, list[StepItem]]:
    """A conversation of 1,700 tokens ran and finished; its next turn (45 rows to prefill after the cached
    1,701) prefills beside another conversation's decoding: the round of that prefill."""
    target = RecordingTarget()
    s = _scheduler(target, tile, **cfg)
    history = _tokens(1, 1700)
    first = s.submit(GenerationRequest(history, max_tokens=2))
    other = s.submit(GenerationRequest(np.concatenate([history[:1600], _tokens(2, 100)]), max_tokens=40))
    while not first.finished:
        s.step()
    before = len(target.rounds)
    turn = s.submit(GenerationRequest(np.concatenate([history, [5, 5], _tokens(3, 44)]), max_tokens=32))
    while turn.t_first_token is None:
        s.step()
    assert other.slot is not None and not other.finished
    assert turn.cached_tokens >= 1700  # it starts from the first conversation's cells
    (items,) = target.rounds[before:]  # one round: the next turn's rows and the other's verify
    assert any(it.seq_id == turn.slot and len(it.tokens) == 45 for it in items) and len(items) == 2
    return s, items


def test_the_scheduler_pads_a_next_turns_prefill_round_on_its_sequence():
    s, items = _next_turn_round(64)
    assert sum(len(it.tokens) + it.tile_pad for it in items) == 64
    carrier = max(items, key=lambda it: len(it.tokens))
    assert carrier.tile_pad == 64 - sum(len(it.tokens) for it in items)
    assert s.stats.tile_pads == 1 and s.stats.tile_pad_rows == carrier.tile_pad
    assert s.tile_fit.tile != 1.0 and s.tile_fit.below == 1.0  # its decode time taught the tile's price


@pytest.mark.parametrize("cfg", [{}, {"verify_shape": "bucketed"}])
def test_no_pads_without_a_tile_or_with_shape_stable_verifies(cfg):
    tile = 0 if not cfg else 64
    s, items = _next_turn_round(tile, **cfg)
    assert all(it.tile_pad == 0 for it in items) and s.stats.tile_pads == 0
