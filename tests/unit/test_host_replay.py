"""The host replay's pure parts (bench/host_replay.py): its decode tables and its stand-in decode."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from specray.bench import host_replay
from specray.bench.host_replay import ReplayDecode, parse_table


def test_doctests():
    failed, attempted = doctest.testmod(host_replay)
    assert attempted >= 5 and failed == 0


@pytest.mark.parametrize("bad", ["", "1:", "0:1.5", "2:-1", "x:1", "1=2", "h200"])
def test_a_bad_table_names_the_flag_and_the_bad_part(bad):
    with pytest.raises(ValueError, match="--host-replay"):
        parse_table(bad)


def test_measured_needs_a_calibrated_table():
    with pytest.raises(ValueError, match="calibrat"):
        parse_table("measured", {})
    assert parse_table("measured", {1: 9.5}) == {1: 9.5}


class _Batch:
    def __init__(self, seq_ids, pos, logits):
        self.seq_ids, self.pos, self.logits = np.array(seq_ids), np.array(pos), np.array(logits)
        self.n_tokens = len(seq_ids)


def test_each_output_row_predicts_its_own_sequences_next_token_and_old_rows_are_cleared():
    d = ReplayDecode(n_vocab=8, n_batch=8, eos=7, wait=lambda n: 0.0)
    d.expect(0, np.array([1, 2, 3]))
    d.expect(3, np.array([4, 5, 6, 2]))
    # sequence 3's prompt chunk (no logits but its last row), then sequence 0's verify of 2 rows
    out = d(_Batch([3, 3, 0, 0], [0, 1, 0, 1], [0, 1, 1, 1]))
    assert out.shape == (3, 8) and out.argmax(axis=1).tolist() == [6, 2, 3]
    assert (out.sum(axis=1) == 1).all()
    out = d(_Batch([0], [2], [1]))  # past the recording: end of generation
    assert out.argmax(axis=1).tolist() == [7] and d.buf.sum() == 1  # the last call's rows were zeroed


@pytest.mark.parametrize("extra", [["--plot", "x.png"], ["--repeats", "2"],
                                   ["--tune-sweep"], ["--url", "http://127.0.0.1:1"]])
def test_flags_of_the_timed_or_http_bench_are_refused_with_host_replay(extra, capsys):
    from specray.cli.main import main

    with pytest.raises(SystemExit) as e:  # before any model loads
        main(["bench", "--host-replay", "h100", *extra])
    assert e.value.code == 2 and "--host-replay" in capsys.readouterr().err
