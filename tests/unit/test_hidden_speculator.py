"""The hidden-state speculators' pure logic (mtp, eagle3) over a scripted head (no llama.cpp).

The "target" rows say whose they are (row = [seq, position, token, 0]), and
the scripted head checks every pair it decodes: at KV position q, MTP must be
fed (x_q, target row of q-1) and EAGLE-3 (x_{q+1}, its encoding of the target
row of q); a head output row (marked -1) only right after the seed. Decodes
must land at the next free position of the sequence, so the KV bookkeeping
(deferred pairs, the seed, rollback of drafted pairs) is checked on every call.
Real heads: tests/integration/test_mtp.py, test_eagle3.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.hidden_rows import TAP_NEXTN, pack_rows
from specray.engine.speculator import DraftRequest
from specray.engine.speculators.eagle3 import Eagle3Speculator
from specray.engine.speculators.hidden_base import HiddenDraftParams
from specray.engine.speculators.mtp import MtpParams, MtpSpeculator
from specray.engine.speculators.registry import make_params, make_speculator

W = 4
EOG = 2


def target_rows(seq: int, pos0: int, tokens) -> np.ndarray:
    r = np.zeros((len(tokens), W), dtype=np.float32)
    r[:, 0], r[:, 1], r[:, 2] = seq, np.arange(pos0, pos0 + len(tokens)), tokens
    return r


class ScriptedHead:
    """Proposes script[n] after n committed tokens, then script[n+1], ... (probability 0.9); checks pairs."""

    n_batch = 64

    def __init__(self, script, pos_offset: int, taps=(TAP_NEXTN,)):
        self.script = [int(t) for t in script]
        self.pos_offset = pos_offset
        self.width = W
        self.taps = taps
        self.kv: dict[int, list[tuple[int, tuple]]] = {}
        self.decodes: list[int] = []  # pairs per decode
        self.encoded = 0
        self.fail_next = False

    def encode(self, rows):
        self.encoded += 1
        return rows.copy() if self.pos_offset == 0 else rows + np.array([0, 0, 0, 100], np.float32)  # "g"

    def decode(self, runs):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("scripted failure")
        self.decodes.append(sum(len(t) for _, t, _, _ in runs))
        top, prob, hid = [], [], []
        for seq, toks, pos0, rows in runs:
            kv = self.kv.setdefault(seq, [])
            assert pos0 == len(kv), f"seq {seq}: decode at {pos0}, the cache holds {len(kv)}"
            for j, (t, r) in enumerate(zip(toks, rows)):
                q = pos0 + j
                if r[0] == -1:  # the head's own row: only while drafting, right after the previous pair
                    assert r[1] == q - 1
                else:
                    want_pos = q - 1 if self.pos_offset == 0 else q
                    if want_pos >= 0:
                        assert r[1] == want_pos, f"seq {seq} pos {q}: row of position {r[1]}, want {want_pos}"
                    assert self.pos_offset == 0 or r[3] == 100, "EAGLE-3 rows must be encoded"
                kv.append((int(t), tuple(r.tolist())))
            n_tok = len(kv) - self.pos_offset  # MTP: kv positions = tokens seen; EAGLE-3 one more token
            top.append(self.script[n_tok] if n_tok < len(self.script) else EOG)
            prob.append(0.9)
            hid.append([-1, pos0 + len(toks) - 1, 0, 0])
        return np.array(top, np.int32), np.array(prob), np.array(hid, np.float32)

    def seq_rm(self, seq, p0):
        self.kv[seq] = self.kv.get(seq, [])[:p0]

    def is_eog(self, t):
        return t == EOG

    def decode_costs(self):
        return {1: 0.001, 4: 0.002}


def make(kind: str, script, n_max=3, **kw):
    cls, off = (MtpSpeculator, 0) if kind == "mtp" else (Eagle3Speculator, -1)
    head = ScriptedHead(script, off, taps=(TAP_NEXTN,) if kind == "mtp" else (2, 5, 9))
    return cls(HiddenDraftParams(n_max=n_max, audit=True, **kw), head), head


def commit(spec, round_id, chunks):
    """The target committed chunks (seq, pos, tokens): the round's record, then process() per chunk."""
    rec = pack_rows(round_id, spec.taps, (W,) if spec.name == "mtp" else (1, 1, 2),
                    [(s, p, np.array(t, np.int32), target_rows(s, p, t)) for s, p, t in chunks])
    spec.take_hidden(rec)
    for s, p, t in chunks:
        spec.process(s, np.array(t, np.int32), p)


def req(seq, history, n_max=8):
    return DraftRequest(seq, np.array(history, np.int32), n_max)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_pairs_seed_and_rollback(kind):
    script = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    spec, head = make(kind, script)
    spec.begin(0, np.array(script[:4], np.int32))
    commit(spec, 1, [(0, 0, script[:4])])  # prompt
    assert head.decodes == []  # deferred to the draft call
    (d,) = spec.draft([req(0, script[:5])])  # last sampled token script[4]
    assert d.tolist() == script[5:8]
    assert len(head.decodes) == 3 and head.decodes[0] == (5 if kind == "mtp" else 4)  # pairs + seed, then 1, 1
    seed_pos = 4 + spec.pos_offset
    assert len(head.kv[0]) == seed_pos + 1  # drafted pairs left the KV, the seed stays
    assert head.kv[0][seed_pos][0] == script[4]
    # the target accepted 2 of 3: commits [x4, d1, d2]; the seed pair is not decoded again
    commit(spec, 2, [(0, 4, script[4:7])])
    (d,) = spec.draft([req(0, script[:8])])
    assert d.tolist() == script[8:11]
    assert head.decodes[3] == 3  # two new committed pairs + the new seed
    kv_tokens = [t for t, _ in head.kv[0]]
    assert kv_tokens == (script[:8] if kind == "mtp" else script[1:8])
    assert spec.counters.mismatched == spec.counters.unsynced == spec.counters.lost == 0
    if kind == "eagle3":
        assert head.encoded == 2  # one encoder call per draft call, all pending rows at once
    # audit: every committed token's row, by position
    assert sorted(spec.audit[0]) == list(range(7))
    assert all(int(row[1]) == pos and int(row[0]) == 0 for pos, (_, row) in spec.audit[0].items())


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_chunks_committed_without_a_draft_in_between_pair_across_the_boundary(kind):
    """A prompt in two chunks, then two rounds without drafts: the first pair of each chunk takes the row
    of the previous chunk's last position (the scripted head checks every row's position)."""
    script = list(range(10, 40))
    spec, head = make(kind, script)
    spec.begin(0, np.array(script[:6], np.int32))
    commit(spec, 1, [(0, 0, script[:4])])
    commit(spec, 2, [(0, 4, script[4:6])])
    commit(spec, 3, [(0, 6, script[6:7])])  # a round decoded without a draft (e.g. the cost policy said no)
    commit(spec, 4, [(0, 7, script[7:8])])
    (d,) = spec.draft([req(0, script[:9])])
    assert d.tolist() == script[9:12]
    assert head.decodes[0] == (9 if kind == "mtp" else 8)
    assert [t for t, _ in head.kv[0]] == (script[:9] if kind == "mtp" else script[1:9])


def test_all_slots_share_each_draft_step():
    script = list(range(10, 40))
    spec, head = make("mtp", script, n_max=4)
    for s in range(4):
        spec.begin(s, np.array(script[:3], np.int32))
    commit(spec, 1, [(s, 0, script[:3]) for s in range(4)])
    drafts = spec.draft([req(s, script[:4]) for s in range(4)])
    assert all(d.tolist() == script[4:8] for d in drafts)
    assert head.decodes == [16, 4, 4, 4]  # step 1: 4 x (3 pairs + seed); then one pair per slot per step


def test_rows_of_another_sequence_stop_that_sequence_only():
    script = list(range(10, 30))
    spec, head = make("mtp", script)
    for s in (0, 1):
        spec.begin(s, np.array(script[:3], np.int32))
    # the record swaps the sequences' ids (llama.cpp 28286): row positions fit, tokens do not
    rec = pack_rows(1, spec.taps, (W,), [(0, 0, np.array([50, 51, 52], np.int32), target_rows(1, 0, [50, 51, 52])),
                                         (1, 0, np.array(script[:3], np.int32), target_rows(0, 0, script[:3]))])
    spec.take_hidden(rec)
    spec.process(0, np.array(script[:3], np.int32), 0)
    spec.process(1, np.array([50, 51, 52], np.int32), 0)
    assert spec.counters.mismatched == 2 and spec.counters.lost == 2
    assert [len(d) for d in spec.draft([req(0, script[:4]), req(1, [50, 51, 52, 53])])] == [0, 0]
    assert head.decodes == []


def test_missing_rows_and_unsynced_requests_give_no_draft():
    script = list(range(10, 30))
    spec, head = make("mtp", script)
    spec.begin(0, np.array(script[:3], np.int32))
    spec.process(0, np.array(script[:3], np.int32), 0)  # no record this round
    assert spec.counters.mismatched == 1 and spec.seqs[0].lost
    spec.begin(1, np.array(script[:3], np.int32))
    commit(spec, 1, [(1, 0, script[:3])])
    (d,) = spec.draft([req(1, script[:6])])  # the history is ahead of what was committed
    assert len(d) == 0 and spec.counters.unsynced == 1
    spec.begin(0, np.array(script[:3], np.int32))  # a new sequence in the slot starts clean
    commit(spec, 2, [(0, 0, script[:3])])
    assert len(spec.draft([req(0, script[:4])])[0]) == 3


def test_a_failed_head_decode_keeps_the_queue_and_recovers():
    script = list(range(10, 30))
    spec, head = make("mtp", script)
    spec.begin(0, np.array(script[:3], np.int32))
    commit(spec, 1, [(0, 0, script[:3])])
    head.fail_next = True
    assert len(spec.draft([req(0, script[:4])])[0]) == 0 and spec.counters.failures == 1
    assert head.kv.get(0, []) == []
    assert spec.draft([req(0, script[:4])])[0].tolist() == script[4:7]


def test_end_of_generation_and_p_min_stop_a_draft():
    script = [10, 11, 12, 13, EOG, 15]
    spec, _ = make("mtp", script, n_max=5)
    spec.begin(0, np.array(script[:2], np.int32))
    commit(spec, 1, [(0, 0, script[:2])])
    assert spec.draft([req(0, script[:3])])[0].tolist() == [13, EOG]
    spec, _ = make("mtp", script, n_max=5, p_min=0.95)
    spec.begin(0, np.array(script[:2], np.int32))
    commit(spec, 1, [(0, 0, script[:2])])
    assert len(spec.draft([req(0, script[:3])])[0]) == 0


def test_registry_names_what_the_hidden_speculators_need():
    for name, flag in (("mtp", "--mtp"), ("eagle3", "--eagle3-model")):
        with pytest.raises(ValueError) as e:
            make_speculator(name)
        assert flag in str(e.value)
        assert make_params(name, {"n_max": 5}).n_max == 5
        with pytest.raises(ValueError, match=name):
            make_params(name, {"n_maximum": 5})
    assert isinstance(make_params("mtp"), MtpParams)
