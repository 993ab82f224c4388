"""ngram_simple: llama.cpp's common_ngram_simple_draft, stateless."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.speculators.ngram_simple import (
    NgramSimpleParams,
    NgramSimpleSpeculator,
    ngram_simple_draft,
)

from ._spec_helpers import arr, check_stats, draft1, run_lifecycle


def reference(history, n, m):
    """Line-by-line port of llama.cpp common_ngram_simple_draft (tokens = history[:-1])."""
    tokens = [int(t) for t in history[:-1]]
    sampled = int(history[-1])
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = tokens[cur_len - n + 1 :] + [sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):
        if tokens[j : j + n] == pattern:
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return tokens[match_pos + n : match_pos + n + copy_max]


def test_basic_match_and_continuation():
    h = arr(0, 1, 2, 3, 4, 5, 6, 9, 1, 2)
    assert ngram_simple_draft(h, 2, 4).tolist() == [3, 4, 5, 6]
    assert ngram_simple_draft(h, 2, 4).dtype == np.int32


def test_empty_and_short_histories():
    assert len(ngram_simple_draft(arr(), 2, 3)) == 0
    assert len(ngram_simple_draft(arr(5), 2, 3)) == 0
    assert len(ngram_simple_draft(arr(1, 2, 1), 2, 3)) == 0  # shorter than n + m + 2
    # a match exists but len(tokens) = 9 <= n + m + 1 = 9: llama.cpp drafts nothing
    h = arr(7, 1, 2, 3, 4, 5, 6, 1, 8, 1)
    assert ngram_simple_draft(h, 1, 7).tolist() == []
    assert ngram_simple_draft(h, 1, 6).tolist() != []


def test_most_recent_occurrence_wins():
    # [1 2] at j=2 (-> 3 4 5) and j=7 (-> 8 9 6): the later one is used
    h = arr(0, 7, 1, 2, 3, 4, 5, 1, 2, 8, 9, 6, 1, 2)
    assert ngram_simple_draft(h, 2, 3).tolist() == [8, 9, 6]


def test_no_fallback_when_most_recent_match_is_too_close():
    # most recent [1 2] (j=9) is followed by only 1 token before the end (< n): empty,
    # though the older match at j=1 has a full continuation (llama.cpp behaviour)
    h = arr(0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 1, 2)
    assert ngram_simple_draft(h, 2, 3).tolist() == []
    assert reference(h, 2, 3) == []
    assert ngram_simple_draft(h[:-2], 2, 3).tolist() == [3, 4, 5]  # without the close one


def test_periodic_overlapping_history():
    # period 2 <= n: the most recent match leaves fewer than n tokens to copy: empty
    assert ngram_simple_draft(arr(*([1, 2] * 10)), 2, 3).tolist() == []
    # period 3 > n: the overlapping match at j=16 drafts the 2 tokens before the end
    h = arr(*([1, 2, 3] * 7))
    assert ngram_simple_draft(h, 2, 3).tolist() == [1, 2]
    assert ngram_simple_draft(h, 2, 3).tolist() == reference(h, 2, 3)


def test_position_zero_is_never_a_match():
    h = arr(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2)
    assert ngram_simple_draft(h, 2, 3).tolist() == []
    h2 = arr(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2)
    assert ngram_simple_draft(h2, 2, 3).tolist() == [3, 4, 5]


def test_continuation_never_includes_the_last_sampled_token():
    # [4 5] at j=3; m=7 would reach the sampled 5, but copying stops at history[:-1]
    h = arr(0, 8, 8, 4, 5, 11, 12, 13, 14, 15, 4, 5)
    assert ngram_simple_draft(h, 2, 7).tolist() == [11, 12, 13, 14, 15, 4]
    assert reference(h, 2, 7) == [11, 12, 13, 14, 15, 4]


@pytest.mark.parametrize("seed", range(6))
def test_matches_llama_cpp_reference_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    # values whose int32 bytes overlap across token boundaries (unaligned byte matches)
    alphabet = np.array([0, 1, 256, 65536, 16777216, 16843009, 2], dtype=np.int32)
    for _ in range(150):
        L = int(rng.integers(1, 60))
        h = alphabet[rng.integers(0, int(rng.integers(2, 8)), L)]
        n, m = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        assert ngram_simple_draft(h, n, m).tolist() == reference(h, n, m)


def test_unaligned_byte_match_is_not_a_token_match():
    # bytes of [1, 0, 256] hold 8 zero bytes at an unaligned offset, i.e. the bytes of
    # the pattern [0, 0]; only token-aligned matches count
    h = arr(9, 1, 0, 256, 5, 5, 5, 5, 5, 5, 0, 0)
    assert h[:4].tobytes().find(arr(0, 0).tobytes()) % 4 != 0
    assert ngram_simple_draft(h, 2, 3).tolist() == reference(h, 2, 3) == []
    # with an aligned occurrence before the unaligned one, that one is found
    h2 = arr(9, 0, 0, 7, 8, 9, 1, 0, 256, 5, 5, 5, 0, 0)
    assert ngram_simple_draft(h2, 2, 3).tolist() == reference(h2, 2, 3) == [7, 8, 9]


def test_params_validation():
    assert NgramSimpleParams().size_n == 12 and NgramSimpleParams().size_m == 48
    with pytest.raises(ValueError):
        NgramSimpleParams(size_n=0)
    with pytest.raises(ValueError):
        NgramSimpleParams(bogus=1)


def test_speculator_truncates_to_n_max_and_is_stateless():
    sp = NgramSimpleSpeculator(NgramSimpleParams(size_n=2, size_m=4))
    h = arr(0, 1, 2, 3, 4, 5, 6, 9, 1, 2)
    assert draft1(sp, 0, h, n_max=2).tolist() == [3, 4]
    # another seq id, no begin: same answer (no state)
    assert draft1(sp, 5, h, n_max=8).tolist() == [3, 4, 5, 6]
    assert len(draft1(sp, 5, h, n_max=0)) == 0


def test_lifecycle_and_stats():
    rng = np.random.default_rng(1)
    block = rng.integers(100, 200, 40).tolist()
    prompt = rng.integers(0, 50, 30).tolist() + block + [7]
    sp = NgramSimpleSpeculator(NgramSimpleParams(size_n=3, size_m=8))
    mine = run_lifecycle(sp, prompt, block + [1, 2, 3], n_max=8)
    assert mine["nonempty"] > 0 and mine["tok_acc"] > 20  # the repeated block is drafted
    check_stats(sp, mine)
