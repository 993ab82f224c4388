"""The round's price for the draft planner: the decode plus the host's work, learnt from rounds."""

from __future__ import annotations

import doctest
import functools

import numpy as np
import pytest

from specray.engine import round_stages
from specray.engine.policy import host_cost, lookup_gate, round_price
from specray.engine.cost import DecodeCostModel
from specray.engine.policy.host_cost import HostCostModel
from specray.engine.policy.lookup_gate import LookupGate
from specray.engine.policy.planner import plan_draft_lengths
from specray.engine.policy.round_price import RoundPricer

H100 = {1: 0.0016, 2: 0.0025, 4: 0.0025, 8: 0.0025, 16: 0.0040, 32: 0.0070}


@pytest.mark.parametrize("mod", [host_cost, lookup_gate, round_price, round_stages])
def test_doctests(mod):
    assert doctest.testmod(mod).failed == 0


def test_host_cost_follows_the_machine():
    m = HostCostModel()
    for i in range(300):  # the tokens a round emits (sequences + accepted drafts) cost nothing here
        m.observe(1 + i % 4, i % 5, 0.0005 + 0.0001 * (1 + i % 4), 1 + i % 4 + i % 3)
    assert m.round_seconds(2, 0) == pytest.approx(0.0007, rel=0.02)
    for i in range(1500):  # the host got twice as slow: the model follows within its memory
        m.observe(1 + i % 4, i % 5, 2 * (0.0005 + 0.0001 * (1 + i % 4)), 1 + i % 4 + i % 3)
    assert m.round_seconds(2, 0) == pytest.approx(0.0014, rel=0.02)
    m.observe(0, 3, 1.0)  # a round without decoding sequences teaches nothing
    m.observe(2, 3, -1.0)
    assert m.round_seconds(2, 0) == pytest.approx(0.0014, rel=0.02)


def test_a_flat_gpu_table_sends_its_free_draft_tail_only_while_host_work_is_unpriced():
    # 2-8 rows cost the same on the GPU: priced by the decode alone every draft token up to 8 rows is free and
    # sent, however unlikely; each draft row's host work (verify, rollback, mirror) makes the unlikely tail lose
    probs = [np.array([0.9, 0.8, 0.1, 0.05, 0.03])]
    decode_only = RoundPricer(DecodeCostModel(H100, learn=False))
    priced = RoundPricer(DecodeCostModel(H100, learn=False))
    rng = np.random.default_rng(0)
    for _ in range(400):  # 0.4 ms a round, 0.1 ms a draft row
        rows = int(rng.integers(0, 8))
        priced.host.observe(1, rows, 0.0004 + 0.0001 * rows)
    assert priced.host.to_dict()["ms_per_draft_row"] == pytest.approx(0.1, rel=0.05)
    free = plan_draft_lengths(probs, 1, lambda n: decode_only.price(n, 1, 1, None))
    paid = plan_draft_lengths(probs, 1, lambda n: priced.price(n, 1, 1, None))
    assert free == [5] and paid == [3]


def _graph_decode(rows: int, since_change: int) -> float:
    """A decode on a GPU with CUDA graphs, the H100's shape (SmolLM2): 1.46 ms for a row replayed, ~0.05 ms per
    extra row, the first decode of a new shape run uncaptured (1.8x) and the second capturing (1.6x)."""
    return (0.00146 + 0.00005 * (rows - 1)) * (1.8 if since_change == 0 else 1.6 if since_change == 1 else 1.0)


def test_a_change_of_batch_shape_is_priced_there_and_back_as_cuda_graphs_charge_it():
    p = RoundPricer(DecodeCostModel({1: 0.0027, 2: 0.0031, 4: 0.0031, 8: 0.0032}))  # an uncaptured calibration
    since, last = 0, 0
    for i in range(600):  # mostly plain decodes, a 3-token draft every 10th round (and the way back)
        rows = 4 if i % 10 == 0 else 1
        since = since + 1 if rows == last else 0
        last = rows
        p.observe([rows], _graph_decode(rows, since), None, False, 1, rows - 1, 0.0)
    assert p.cost.shape_change_penalty == pytest.approx(1.4, abs=0.15)
    assert p.cost.first_decode_penalty == pytest.approx(0.8, abs=0.1)
    # the table learnt the decodes as if steady: a replayed row, not the uncaptured calibration's 2.7 ms
    assert p.cost.cost(1) == pytest.approx(0.00146, rel=0.1)
    assert p.last_shape == 1 and p.since_change >= 2
    # a draft: its own uncaptured decode, and two upset plain decodes on the way back
    c = p.cost
    want = c.cost(4) * (1 + c.first_decode_penalty) + c.cost(1) * c.shape_change_penalty + p.host.round_seconds(1, 3)
    assert p.price(4, 1, 1, None) == pytest.approx(want, rel=1e-6)
    assert p.price(1, 1, 1, None) == pytest.approx(p.cost.cost(1) + p.host.round_seconds(1, 0))
    # so a 3-token draft at 60% acceptance per token no longer pays, and one at 95% still does
    price = functools.partial(p.price, base_rows=1, n_decoding=1, cells=None)
    assert plan_draft_lengths([np.array([0.6, 0.36, 0.22])], 1, price) == [0]
    assert plan_draft_lengths([np.array([0.95, 0.9, 0.86])], 1, price) == [3]
    flat = RoundPricer(p.cost.copy())  # with no penalty learnt (a CPU), the 60% draft is sent
    assert flat.cost.shape_change_penalty == 0
    assert plan_draft_lengths([np.array([0.6, 0.36, 0.22])], 1,
                              functools.partial(flat.price, base_rows=1, n_decoding=1, cells=None)) == [3]


def test_prefill_rounds_teach_neither_the_table_nor_the_host_model():
    p = RoundPricer(DecodeCostModel({1: 0.002, 64: 0.02}))
    before = p.cost.table()
    p.observe([64], 0.5, None, True, 1, 0, 0.1)
    assert p.cost.table() == before and p.host.rounds == 0 and p.last_shape == 64


def test_a_speculator_whose_winnings_pay_its_look_ups_is_always_asked():
    g = LookupGate(warmup=8, max_probe_every=4)
    for i in range(200):
        for name, won in (("suffix", 2 if i % 5 == 0 else 0), ("ngram_mod", 0)):
            g.asked(name, 1, 0.00004)
            g.won(name, won)
    # suffix wins 0.4 tokens a look-up: worth 0.64 ms at 1.6 ms a token, far above its 0.04 ms look-up
    assert all(g.ask("suffix", [0, 1], [0, 1], 0.0016) == [0, 1] for _ in range(50))
    asked = [g.ask("ngram_mod", [0], [0], 0.0016) for _ in range(40)]
    # probed on the sequence's gated rounds 1, 2, 4, then every 4th
    assert [i for i, a in enumerate(asked) if a] == [0, 1, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert g.skipped["ngram_mod"] == 28
    # on a CPU round of 10 ms a token, a speculator that wins once in 200 look-ups pays its 0.04 ms
    g.won("ngram_mod", 2)
    assert g.ask("ngram_mod", [0, 1], [0, 1], 0.010) == [0, 1]
    g.forget("ngram_mod")  # a rebuilt instance starts afresh
    assert all(g.ask("ngram_mod", [0], [0], 0.0016) == [0] for _ in range(8))


def test_probes_are_per_sequence_back_off_and_start_at_once_for_a_new_sequence():
    g = LookupGate(warmup=4, max_probe_every=16)
    for _ in range(8):
        g.asked("s", 1, 0.00004)
        g.won("s", 0)
    probes = [i for i in range(100) if g.ask("s", [0], [3], 0.0016)]
    assert probes == [0, 1, 3, 7, 15, 31, 47, 63, 79, 95]  # gated rounds 1, 2, 4, 8, 16, then every 16th
    assert g.ask("s", [0, 1], [3, 4], 0.0016) == [1]  # a sequence seen first now is probed at once
    g.end(3)  # the slot's next sequence is new traffic
    assert g.ask("s", [0, 1], [3, 4], 0.0016) == [0, 1]
    g.won("s", 5)  # a probe finds it paying: asked for every sequence while it does
    assert all(g.ask("s", [0, 1], [3, 4], 0.0016) == [0, 1] for _ in range(20))


@pytest.mark.parametrize("seed", range(6))
def test_a_run_of_prices_is_each_size_priced_alone(seed):
    """DecodeCostModel.costs and RoundPricer.prices price a run of sizes in one pass: each the same float as a
    call per size, over learnt tables of one to six sizes, sizes below, inside and past the table, contexts or
    none, and GPU-like shape penalties; and the policy's memoised round price, asked in any order, gives them."""
    from specray.engine.chain import Chain
    from specray.engine.config import ChainConfig
    from specray.engine.policy.policy import DraftPolicy
    from specray.engine.speculators.registry import speculator_factory

    rng = np.random.default_rng(seed)
    penalised = 0
    for _ in range(40):
        sizes = sorted(rng.choice(np.arange(1, 70), int(rng.integers(1, 7)), replace=False).tolist())
        m = DecodeCostModel({n: float(rng.uniform(0.001, 0.05)) for n in sizes},
                            attn_seconds=float(rng.choice([0.0, 3e-7])),
                            shape_ratios=(float(rng.choice([1.0, 1.8])), float(rng.choice([1.0, 1.6]))))
        for _ in range(int(rng.integers(0, 30))):
            m.observe(int(rng.integers(1, 40)), float(rng.uniform(0.001, 0.06)), rng.choice([None, 100.0, 900.0]),
                      since_change=rng.choice([None, 0, 1, 2]))
        p = RoundPricer(m)
        p.last_shape = int(rng.integers(0, 10))
        for _ in range(int(rng.integers(0, 40))):
            p.host.observe(int(rng.integers(1, 8)), int(rng.integers(0, 30)), float(rng.uniform(0, 0.001)))
        cells = rng.choice([None, 0.0, 64.0, 700.3])
        base, n_dec, n0 = int(rng.integers(1, 9)), int(rng.integers(1, 8)), int(rng.integers(0, 12))
        n1 = n0 + int(rng.integers(0, 60))
        assert m.costs(n0, n1, cells) == [m.cost(n, cells) for n in range(n0, n1)]
        assert p.prices(n0, n1, base, n_dec, cells) == [p.price(n, base, n_dec, cells) for n in range(n0, n1)]
        penalised += m.shape_change_penalty > 0
    assert penalised > 5  # the shape penalties were in play
    policy = DraftPolicy(Chain(ChainConfig(speculators=["ngram_mod"]), speculator_factory()), m)
    policy.pricer = p
    price = policy.round_price(base, n_dec, cells)
    asked = rng.integers(0, base + 50, 80).tolist()  # below base_rows, past the first run, repeated
    assert [price(n) for n in asked] == [p.price(n, base, n_dec, cells) for n in asked]
