"""native/batch.py's rows: what llama_decode reads from a Batch, whichever way add_seq wrote a run (a run of one
row takes item writes, a longer one slices), and the struct it is handed."""

from __future__ import annotations

import numpy as np

from specray.native.batch import Batch


def _rows(b: Batch) -> list[tuple[int, int, int, int, int]]:
    """(token, position, first sequence id, ids on the row, logits flag) of each row, read through the struct's
    pointers as llama.cpp reads them."""
    st = b.as_struct()
    return [(st.token[i], st.pos[i], st.seq_id[i][0], st.n_seq_id[i], st.logits[i]) for i in range(st.n_tokens)]


def test_runs_of_one_row_and_of_several_write_the_same_rows():
    b = Batch(16)
    assert b.add_seq(3, np.array([11], dtype=np.int32), 40, 1) == 0
    assert b.add_seq(0, np.array([5, 6, 7], dtype=np.int32), 9, 2) == 1
    assert b.add_seq(2, np.array([8], dtype=np.int32), 0, 0) == 4
    assert b.add_seq(1, [12], 7, 1) == 5  # a list of ids, as well as an array
    assert _rows(b) == [(11, 40, 3, 1, 1), (5, 9, 0, 1, 0), (6, 10, 0, 1, 1), (7, 11, 0, 1, 1), (8, 0, 2, 1, 0),
                        (12, 7, 1, 1, 1)]
    assert (b.n_tokens, b.n_outputs) == (6, 4)


def test_a_cleared_batch_rewrites_rows_a_tree_left_with_several_ids():
    b = Batch(8, max_seqs=3)
    b.add_rows(np.array([1, 2], dtype=np.int32), np.array([5, 6], dtype=np.int32), [[0, 4, 5], [0, 4]])
    assert _rows(b) == [(1, 5, 0, 3, 1), (2, 6, 0, 2, 1)]
    b.clear()
    b.add_seq(2, np.array([9], dtype=np.int32), 30, 0)
    b.add_seq(1, np.array([3, 4], dtype=np.int32), 12, 1)
    assert _rows(b) == [(9, 30, 2, 1, 0), (3, 12, 1, 1, 0), (4, 13, 1, 1, 1)]
    assert b.n_outputs == 1


def test_a_run_past_the_capacity_is_refused_and_leaves_the_batch_as_it_was():
    b = Batch(2)
    b.add_seq(0, np.array([1, 2], dtype=np.int32), 0, 1)
    for run in (np.array([3], dtype=np.int32), np.array([3, 4], dtype=np.int32)):
        try:
            b.add_seq(1, run, 0, 1)
        except ValueError as e:
            assert "batch overflow" in str(e)
        else:
            raise AssertionError("an overflowing run was accepted")
    assert (b.n_tokens, b.n_outputs) == (2, 1) and _rows(b) == [(1, 0, 0, 1, 0), (2, 1, 0, 1, 1)]
