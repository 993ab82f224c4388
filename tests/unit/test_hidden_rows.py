"""The hidden-rows record and its routing checks (engine/hidden_rows.py), no model."""

from __future__ import annotations

import doctest
import pickle

import numpy as np
import pytest

from specray.engine import hidden_rows
from specray.engine.hidden_rows import TAP_NEXTN, HiddenRows, RowMismatch, RowStash, mtp_input_rows, pack_rows


def rows_of(seq: int, pos0: int, n: int, width: int = 4) -> np.ndarray:
    """Rows that say whose they are: [seq, position, 0, ...]."""
    r = np.zeros((n, width), dtype=np.float32)
    r[:, 0] = seq
    r[:, 1] = np.arange(pos0, pos0 + n)
    return r


def record(round_id: int = 1) -> HiddenRows:
    return pack_rows(round_id, (TAP_NEXTN, 7), (2, 2), [
        (3, 10, np.array([5, 6, 7], np.int32), rows_of(3, 10, 3)),
        (0, 0, np.array([1, 2], np.int32), rows_of(0, 0, 2)),
    ])


def test_pack_is_one_matrix_with_per_sequence_views():
    r = record()
    r.validate()
    assert r.rows.shape == (5, 4) and r.rows.dtype == np.float32 and r.rows.flags.c_contiguous
    assert r.n_rows == 5 and r.nbytes == 5 * 4 * 4 and len(r) == 2 and r.width == 4
    e = r.for_seq(3)
    assert e.pos0 == 10 and e.tokens.tolist() == [5, 6, 7] and e.positions.tolist() == [10, 11, 12]
    assert e.rows[:, 0].tolist() == [3, 3, 3] and e.rows[:, 1].tolist() == [10, 11, 12]
    assert r.for_seq(0).rows[:, 1].tolist() == [0, 1] and r.for_seq(9) is None
    # taps select columns: nextn = the first 2, layer 7 = the next 2
    assert r.columns((TAP_NEXTN,)) == slice(0, 2) and r.columns((7,)) == slice(2, 4)
    assert r.columns((TAP_NEXTN, 7)) == slice(0, 4)
    with pytest.raises(RowMismatch):
        r.columns((5,))


def test_record_survives_pickling_as_ray_ships_it():
    r = pickle.loads(pickle.dumps(record(), protocol=5))
    r.validate()
    assert r.for_seq(3).rows[:, 1].tolist() == [10, 11, 12]


@pytest.mark.parametrize("broken", ["offsets", "rows", "dup"])
def test_validate_rejects_inconsistent_records(broken):
    r = record()
    if broken == "offsets":
        r.offsets = np.array([0, 2, 9])
    elif broken == "rows":
        r.rows = r.rows[:, :3]
    else:
        r.seq_ids = np.array([3, 3], np.int32)
    with pytest.raises(RowMismatch):
        r.validate()


def test_pack_refuses_rows_that_do_not_match_tokens():
    with pytest.raises(RowMismatch):
        pack_rows(1, (TAP_NEXTN,), (4,), [(0, 0, np.array([1, 2], np.int32), rows_of(0, 0, 3))])


def test_stash_routes_rows_by_sequence_and_position():
    st = RowStash()
    st.take(record())
    got = st.pop(0, [1, 2], 0)
    assert got[:, 0].tolist() == [0, 0] and got[:, 1].tolist() == [0, 1]
    got = st.pop(3, np.array([5, 6, 7]), 10)
    assert got[:, 0].tolist() == [3, 3, 3]
    assert st.pending == {}


def test_stash_column_subset():
    st = RowStash()
    st.take(record(), slice(2, 4))
    assert st.pop(3, [5, 6, 7], 10).shape == (3, 2)


@pytest.mark.parametrize("case", ["other_sequence", "wrong_position", "wrong_tokens", "missing"])
def test_stash_refuses_misrouted_rows(case):
    st = RowStash()
    st.take(record())
    with pytest.raises(RowMismatch):
        if case == "other_sequence":  # sequence 1 got nothing this round (cross-slot mixing would hand it 0's)
            st.pop(1, [1, 2], 0)
        elif case == "wrong_position":
            st.pop(3, [5, 6, 7], 11)
        elif case == "wrong_tokens":
            st.pop(3, [5, 6, 8], 10)
        else:
            st.pop(0, [1, 2], 0)
            st.pop(0, [3], 2)


def test_stash_skips_stale_rows_of_unprocessed_rounds_and_drops_ended_sequences():
    st = RowStash()
    st.take(pack_rows(1, (TAP_NEXTN,), (4,), [(0, 0, np.array([1, 2], np.int32), rows_of(0, 0, 2))]))
    st.take(pack_rows(2, (TAP_NEXTN,), (4,), [(0, 2, np.array([3], np.int32), rows_of(0, 2, 1))]))
    assert st.pop(0, [3], 2)[0, 1] == 2 and st.stale == 1
    st.take(record())
    st.drop(3)
    assert 3 not in st.pending and st.stale == 2


def test_mtp_input_rows_pair_each_token_with_the_previous_row():
    r = rows_of(0, 5, 3)
    prev = rows_of(0, 4, 1)[0]
    inp = mtp_input_rows(r, prev)
    assert inp[:, 1].tolist() == [4, 5, 6]


def test_docstring_examples():
    res = doctest.testmod(hidden_rows)
    assert res.attempted > 0 and res.failed == 0
