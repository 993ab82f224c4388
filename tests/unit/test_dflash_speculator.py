"""The `dflash` speculator's pure logic (engine/speculators/dflash.py) over a scripted draft (no llama.cpp).

The "target" rows say whose they are (row = [seq, position, token]); the
scripted draft keeps a cache per sequence (position -> row or block token),
refuses an injection or a block at a position it already holds, checks that a
block's anchor sits right after the sequence's last injected row, and drafts
script[n + 1 ..] after n committed tokens. So every test also checks the
window bookkeeping: what the cache holds after acceptance, rejection, a
context shift, a failure. Real draft: tests/integration/test_dflash.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.cost import DecodeCostModel
from specray.engine.hidden_rows import pack_rows
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.dflash import DFlashParams, DFlashSpeculator, block_draft_seconds
from specray.engine.speculators.registry import MODEL_SPECULATOR_PARAMS, make_params, make_speculator

W = 3
EOG = 2
TAPS = (1, 15, 27)


def target_rows(seq: int, pos0: int, tokens) -> np.ndarray:
    r = np.zeros((len(tokens), W), dtype=np.float32)
    r[:, 0], r[:, 1], r[:, 2] = seq, np.arange(pos0, pos0 + len(tokens)), tokens
    return r


class ScriptedDFlash:
    """Drafts script[n + 1 : n + 1 + k] for a block anchored at position n (probability 0.9)."""

    width = W
    taps = TAPS
    block_size = 8

    def __init__(self, script) -> None:
        self.script = [int(t) for t in script]
        self.cache: dict[int, dict[int, tuple]] = {}
        self.injections: list[list[tuple[int, int, int]]] = []  # per call: (seq, pos0, rows)
        self.blocks: list[list[tuple[int, int, int, int]]] = []
        self.fail: str | None = None
        self.check_pos = True  # a row's position is where it goes (off after a context shift moved the rows)

    def inject(self, runs):
        self.injections.append([(s, p, len(r)) for s, p, r in runs])
        for seq, pos0, rows in runs:
            c = self.cache.setdefault(seq, {})
            for j, r in enumerate(rows):
                assert pos0 + j not in c, f"seq {seq}: position {pos0 + j} injected twice"
                assert int(r[0]) == seq and (int(r[1]) == pos0 + j or not self.check_pos), f"{seq} {pos0 + j}: {r}"
                c[pos0 + j] = ("row", int(r[2]))
        if self.fail == "inject":
            self.fail = None
            raise RuntimeError("scripted injection failure")

    def draft_blocks(self, blocks):
        self.blocks.append(list(blocks))
        out = []
        for seq, pos, anchor, n in blocks:
            c = self.cache.setdefault(seq, {})
            assert pos not in c and (pos == 0 or (pos - 1) in c), f"seq {seq}: block at {pos}, cache {sorted(c)}"
            for j in range(n + 1):
                c[pos + j] = ("block", anchor if j == 0 else -1)
            toks = [self.script[t] if t < len(self.script) else EOG for t in range(pos + 1, pos + 1 + n)]
            out.append((np.array(toks, np.int32), np.full(n, 0.9)))
        if self.fail == "block":
            self.fail = None
            raise RuntimeError("scripted block failure")
        return out

    def kv_remove(self, seq, p0, p1=-1):
        c = self.cache.get(seq, {})
        self.cache[seq] = {p: v for p, v in c.items() if not (p >= p0 and (p1 < 0 or p < p1))}

    def kv_shift(self, seq, p0, p1, delta):
        c = self.cache.get(seq, {})
        self.cache[seq] = {p + delta if p0 <= p < p1 else p: v for p, v in c.items()}

    def is_eog(self, t):
        return t == EOG

    def decode_costs(self):
        return {1: 0.002, 8: 0.003, 32: 0.006}

    def inject_costs(self):
        return {1: 0.001, 8: 0.0015}

    def rows_held(self, seq):
        """Token of each cached row, by position (block cells must never stay)."""
        c = self.cache.get(seq, {})
        assert all(kind == "row" for kind, _ in c.values()), f"seq {seq}: block cells left in the cache"
        return {p: t for p, (_, t) in sorted(c.items())}


def make(script, **params):
    head = ScriptedDFlash(script)
    return DFlashSpeculator(DFlashParams(audit=True, **params), head), head


def commit(spec, round_id, chunks):
    """The target committed chunks (seq, pos, tokens): the round's record, then process() per chunk."""
    rec = pack_rows(round_id, (0, *TAPS), (1, 1, 1, 1),  # another tap first: dflash picks its own columns
                    [(s, p, np.array(t, np.int32),
                      np.concatenate([np.full((len(t), 1), 99, np.float32), target_rows(s, p, t)], axis=1))
                     for s, p, t in chunks])
    spec.take_hidden(rec)
    for s, p, t in chunks:
        spec.process(s, np.array(t, np.int32), p)


def req(seq, history, n_max=8):
    return DraftRequest(seq, np.array(history, np.int32), n_max)


def test_block_positions_after_acceptance_and_rejection():
    script = list(range(10, 60))
    spec, head = make(script, n_max=5)
    spec.begin(0, np.array(script[:6], np.int32))
    commit(spec, 1, [(0, 0, script[:6])])  # the prompt: 6 rows, not injected yet (deferred to the draft)
    assert head.injections == [] and spec.seqs[0].window.pending == 6
    (d,) = spec.draft([req(0, script[:7])])  # last sampled token script[6], anchor at position 6
    assert d.tolist() == script[7:12]
    assert head.injections == [[(0, 0, 6)]] and head.blocks == [[(0, 6, script[6], 5)]]
    assert head.rows_held(0) == dict(enumerate(script[:6]))  # the block's cells left
    # the target accepted 2 of 5: it commits [x6, d1, d2] with their rows
    commit(spec, 2, [(0, 6, script[6:9])])
    w = spec.seqs[0].window
    assert (w.lo, w.injected, w.end) == (0, 6, 9)
    (d,) = spec.draft([req(0, script[:10])])
    assert d.tolist() == script[10:15]
    assert head.injections[-1] == [(0, 6, 3)] and head.blocks[-1] == [(0, 9, script[9], 5)]
    assert head.rows_held(0) == dict(enumerate(script[:9]))
    # all rejected: only the last token's row comes
    commit(spec, 3, [(0, 9, script[9:10])])
    spec.draft([req(0, script[:11])])
    assert head.blocks[-1] == [(0, 10, script[10], 5)] and list(head.rows_held(0)) == list(range(10))
    assert spec.kv_tokens(0).tolist() == script[:10] and spec.committed(0).tolist() == script[:10]
    assert sorted(spec.audit[0]) == list(range(10))
    c = spec.counters
    assert c.mismatched == c.unsynced == c.lost == c.failures == 0 and c.blocks == 3 and c.injected_rows == 10


def test_one_injection_and_one_block_decode_for_all_slots():
    script = list(range(10, 60))
    spec, head = make(script, n_max=4)
    for s in range(4):
        spec.begin(s, np.array(script[:3], np.int32))
    commit(spec, 1, [(s, 0, script[: 3 + s]) for s in range(4)])  # prompts of 3..6 tokens
    drafts = spec.draft([req(s, script[: 4 + s], n_max=4 - (s == 3)) for s in range(4)])
    assert [d.tolist() for d in drafts] == [script[4 + s : 8 + s - (s == 3)] for s in range(4)]
    assert len(head.injections) == 1 and len(head.blocks) == 1
    assert head.blocks[0] == [(s, 3 + s, script[3 + s], 4 - (s == 3)) for s in range(4)]
    for s in range(4):
        assert list(head.rows_held(s)) == list(range(3 + s))


def test_commit_restarting_earlier_trims_the_window():
    """A commit at an earlier position than the window's end (a target that rolled back): the tail leaves."""
    script = list(range(10, 60))
    spec, head = make(script)
    spec.begin(0, np.array(script[:8], np.int32))
    commit(spec, 1, [(0, 0, script[:8])])
    spec.draft([req(0, script[:9])])
    other = [70, 71, 72]
    commit(spec, 2, [(0, 5, other)])  # positions 5.. are now other tokens
    assert spec.counters.trimmed == 1 and list(head.rows_held(0)) == [0, 1, 2, 3, 4]
    assert spec.committed(0).tolist() == script[:5] + other
    assert [spec.audit[0][q][0] for q in sorted(spec.audit[0])] == script[:5] + other
    spec.draft([req(0, script[:5] + other + [73])])
    assert head.rows_held(0) == {**dict(enumerate(script[:5])), 5: 70, 6: 71, 7: 72}


def test_context_shift_moves_the_cache_and_the_next_block():
    script = list(range(10, 80))
    spec, head = make(script, n_max=3)
    spec.begin(0, np.array(script[:20], np.int32))
    commit(spec, 1, [(0, 0, script[:20])])
    spec.draft([req(0, script[:21])])
    commit(spec, 2, [(0, 20, script[20:22])])  # pending 20, 21
    spec.shift(0, 4, 10)  # keep 0..3, drop 4..13: 14..19 -> 4..9, pending 20, 21 -> 10, 11
    kept = script[:4] + script[14:22]
    assert spec.committed(0).tolist() == kept and spec.counters.shifts == 1
    assert head.rows_held(0) == {p: kept[p] for p in range(10)}
    assert sorted(spec.audit[0]) == list(range(12))
    # the target now continues at position 12 with the shifted history; rows 20, 21 go to positions 10, 11
    head.check_pos = False
    hist = kept + [script[22]]
    (d,) = spec.draft([req(0, hist)])
    assert head.blocks[-1] == [(0, 12, script[22], 3)] and head.injections[-1] == [(0, 10, 2)]
    assert len(d) == 3 and head.rows_held(0) == {p: kept[p] for p in range(12)}


def test_window_bound_keeps_the_last_rows():
    script = list(range(10, 80))
    spec, head = make(script, window=8)
    spec.begin(0, np.array(script[:20], np.int32))
    commit(spec, 1, [(0, 0, script[:20])])
    spec.draft([req(0, script[:21])])
    assert list(head.rows_held(0)) == list(range(12, 20)) and head.injections == [[(0, 12, 8)]]
    commit(spec, 2, [(0, 20, script[20:23])])
    spec.draft([req(0, script[:24])])
    assert list(head.rows_held(0)) == list(range(15, 23))


@pytest.mark.parametrize("where", ["inject", "block"])
def test_a_failed_decode_gives_no_draft_and_recovers(where):
    script = list(range(10, 60))
    spec, head = make(script, n_max=3)
    spec.begin(0, np.array(script[:4], np.int32))
    commit(spec, 1, [(0, 0, script[:4])])
    head.fail = where
    assert len(spec.draft([req(0, script[:5])])[0]) == 0 and spec.counters.failures == 1
    held = head.rows_held(0)
    assert held == ({} if where == "inject" else dict(enumerate(script[:4])))
    (d,) = spec.draft([req(0, script[:5])])
    assert d.tolist() == script[5:8] and list(head.rows_held(0)) == [0, 1, 2, 3]


def test_mismatched_rows_and_unsynced_requests_stop_only_that_sequence():
    script = list(range(10, 60))
    spec, head = make(script)
    for s in (0, 1):
        spec.begin(s, np.array(script[:3], np.int32))
    rec = pack_rows(1, TAPS, (1, 1, 1), [(0, 0, np.array([50, 51, 52], np.int32), target_rows(1, 0, [50, 51, 52])),
                                         (1, 0, np.array(script[:3], np.int32), target_rows(1, 0, script[:3]))])
    spec.take_hidden(rec)
    spec.process(0, np.array(script[:3], np.int32), 0)  # the record says other tokens for seq 0
    spec.process(1, np.array(script[:3], np.int32), 0)
    assert spec.counters.mismatched == 1 and spec.counters.lost == 1 and spec.seqs[0].lost
    d0, d1 = spec.draft([req(0, script[:4]), req(1, script[:4])])
    assert len(d0) == 0 and d1.tolist() == script[4:11]
    (d,) = spec.draft([req(1, script[:9])])  # ahead of what was committed
    assert len(d) == 0 and spec.counters.unsynced == 2


def test_p_min_eog_and_n_min():
    script = [10, 11, 12, 13, EOG, 15, 16, 17, 18, 19]
    spec, head = make(script, n_max=6)
    spec.begin(0, np.array(script[:2], np.int32))
    commit(spec, 1, [(0, 0, script[:2])])
    assert spec.draft([req(0, script[:3])])[0].tolist() == [13, EOG]
    spec, _ = make(script, n_max=6, p_min=0.95)
    spec.begin(0, np.array(script[:2], np.int32))
    commit(spec, 1, [(0, 0, script[:2])])
    assert len(spec.draft([req(0, script[:3])])[0]) == 0
    spec, _ = make(list(range(10, 40)), n_max=6, n_min=4)
    spec.begin(0, np.array([10, 11], np.int32))
    commit(spec, 1, [(0, 0, [10, 11])])
    assert len(spec.draft([req(0, [10, 11, 12], n_max=3)])[0]) == 0  # 3 < n_min


def test_block_size_caps_the_draft_and_the_price_is_one_block():
    spec, head = make(list(range(10, 60)), n_max=20)
    assert spec.max_steps == head.block_size - 1 == 7
    # 4 sequences x 8 block tokens = 32 -> 6 ms; 8 rows injected -> 1.5 ms
    assert spec.draft_seconds(4, 7) == pytest.approx(0.006 + 0.0015)
    assert spec.draft_seconds(4, 30) == spec.draft_seconds(4, 7)
    block, inject = DecodeCostModel(head.decode_costs()), DecodeCostModel(head.inject_costs())
    assert block_draft_seconds(block, inject, 1, 1, 2.0) < block_draft_seconds(block, inject, 4, 7, 2.0)


def test_registry_knows_dflash_and_names_its_flag():
    assert "dflash" in MODEL_SPECULATOR_PARAMS
    with pytest.raises(ValueError, match="--dflash-model"):
        make_speculator("dflash")
    p = make_params("dflash", {"n_max": 5, "window": 64})
    assert isinstance(p, DFlashParams) and (p.n_max, p.window) == (5, 64)
    with pytest.raises(ValueError, match="dflash"):
        make_params("dflash", {"block": 5})
    for f in DFlashParams.model_fields.values():
        assert f.description


def test_doctests_of_the_dflash_pieces():
    import doctest

    from specray.engine import hidden_rows
    from specray.engine.speculators import dflash
    from specray.native import dflash_backend, hidden_heads

    for module in (dflash, hidden_rows, dflash_backend, hidden_heads):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


class _Client:
    """CompanionClient stand-in for the router's dflash proxy: records payloads, answers like the companion."""

    epoch = 1

    def __init__(self):
        self.payloads = []

    def call(self, method, payload, default=None):
        assert method == "hidden_round"
        self.payloads.append(payload)
        return {"drafts": [np.array([7, 8, 9], np.int32) for _ in payload["requests"]], "unsynced": [],
                "inside_s": 0.0, "step_costs": {1: 0.002, 32: 0.006}, "inject_costs": {1: 0.0001, 8: 0.0002},
                "acks": []}


def test_router_proxy_prices_one_block_and_forwards_shifts():
    from specray.deployments.actors.companion_hidden import CompanionDFlashProxy

    client = _Client()
    proxy = CompanionDFlashProxy(DFlashParams(), client, {1: 0.002, 32: 0.006}, inject_table={1: 0.001, 8: 0.002},
                                 block_size=8)
    assert proxy.max_steps == 7  # n_max 15 capped by the block
    assert proxy.draft_seconds(4, 7) == pytest.approx(0.006 + 0.002)  # ONE block of 4 x 8 + 8 injected rows
    assert proxy.draft_seconds(4, 50) == proxy.draft_seconds(4, 7)
    proxy.begin(0, np.array([1, 2, 3], np.int32))
    proxy.shift(0, 1, 1)
    proxy.shift(5, 1, 1)  # a sequence this companion never began: nothing to follow
    (d,) = proxy.draft([DraftRequest(0, np.array([1, 3, 4], np.int32), 2)])
    assert d.tolist() == [7, 8]
    assert [e for e in client.payloads[0]["events"] if e[0] == "shift"] == [("shift", 0, 1, 1)]
    assert proxy.inject_cost.table() == {1: 0.0001, 8: 0.0002}  # the companion's measured injection costs
