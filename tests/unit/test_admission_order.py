"""More requests than slots: a conversation's next turn, whose history is cached, gets a freed slot before a new
conversation (queue_order cached), unless the new one waited queue_max_wait_s; queue_order arrival keeps
first come, first served. The scheduler runs on a stand-in target (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.admission_order import admission_order
from specray.engine.chain import Chain
from specray.engine.config import ChainConfig, EngineConfig
from specray.engine.request import GenerationRequest
from specray.engine.scheduler import Scheduler
from specray.engine.speculators.registry import speculator_factory
from specray.engine.target import StepOutput, StepResult


class OneTokenTarget:
    """Emits token 5 for every sampled row: enough for the scheduler's bookkeeping."""

    def start(self, seq_id, params, prompt, n_keep=0, copy_from=None, restore=None, share=None):
        pass

    def release(self, seq_id, keep=0):
        pass

    def step(self, items):
        results = [StepResult(it.seq_id, np.array([5] if it.sample else [], np.int32)) for it in items]
        return StepOutput(results, 0.0, sum(len(it.tokens) for it in items), 1)


class Tok:
    def token_to_piece(self, token, special=False):
        return b"x"

    def is_eog(self, token):
        return False


def _scheduler(**cfg) -> Scheduler:
    chain = ChainConfig(speculators=[])
    config = EngineConfig(slots=2, calibrate=False, chain=chain, cache_ram=0, **cfg)
    return Scheduler(config, OneTokenTarget(), Tok(), Chain(chain, speculator_factory()), n_ctx=2048)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 1000, n).astype(np.int32)


def _first_admitted_after_a_slot_frees(**cfg):
    """Two long-running sequences fill both slots; a new conversation (C) queues, then the next turn (D) of the
    conversation one of them runs. Which of C and D takes the slot the short one frees?"""
    s = _scheduler(**cfg)
    history = _prompt(1, 300)
    running = s.submit(GenerationRequest(history, max_tokens=50))
    short = s.submit(GenerationRequest(_prompt(2, 40), max_tokens=3))
    s.step()
    assert running.slot is not None and short.slot is not None
    new = s.submit(GenerationRequest(_prompt(3, 200), max_tokens=4))
    turn = s.submit(GenerationRequest(np.concatenate([history, _prompt(4, 20)]), max_tokens=4))
    while not short.finished:
        s.step()
    s.step()  # admission happens at the start of a round
    admitted = [name for name, q in (("new", new), ("turn", turn)) if q.t_admit is not None]
    return admitted, turn


def test_the_next_turn_of_a_cached_conversation_goes_first():
    admitted, turn = _first_admitted_after_a_slot_frees()
    assert admitted == ["turn"]
    assert turn.cached_tokens >= 299  # it starts from the running sequence's cells


def test_arrival_order_keeps_first_come_first_served():
    admitted, _ = _first_admitted_after_a_slot_frees(queue_order="arrival")
    assert admitted == ["new"]


def test_a_request_that_waited_long_enough_goes_ahead():
    admitted, _ = _first_admitted_after_a_slot_frees(queue_max_wait_s=1e-9)
    assert admitted == ["new"]


@pytest.mark.parametrize("rows, waited, want", [
    ([50, 10, 10], [0.0, 0.0, 0.0], [1, 2, 0]),  # ties keep arrival order
    ([50, 10, 90], [30.0, 0.0, 25.0], [0, 2, 1]),  # every overdue one first, in arrival order
    ([], [], []),
])
def test_admission_order(rows, waited, want):
    assert admission_order(rows, waited, max_wait_s=20.0) == want


def test_a_request_that_waits_for_cells_is_counted():
    # one KV pool of 256 cells: the second request has a free slot but no cells until the first ends
    s = Scheduler(EngineConfig(slots=2, calibrate=False, chain=ChainConfig(speculators=[]), cache_ram=0),
                  OneTokenTarget(), Tok(), Chain(ChainConfig(speculators=[]), speculator_factory()), n_ctx=256,
                  shared_cells=256)
    first = s.submit(GenerationRequest(_prompt(5, 150), max_tokens=20))
    second = s.submit(GenerationRequest(_prompt(6, 150), max_tokens=20))
    s.step()
    assert first.slot is not None and second.t_admit is None
    while not first.finished:
        s.step()
    s.step()
    assert second.t_admit is not None
    assert s.prefix_cache.stats()["cell_waits"] >= 2
