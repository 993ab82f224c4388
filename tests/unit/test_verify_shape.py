"""Shape-stable verifies: the padding rule, its config, and the cost policy pricing the padded shape."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from pydantic import ValidationError

from specray.bench import shapes
from specray.engine import verify_shape
from specray.engine.config import EngineConfig
from specray.engine.policy.planner import plan_draft_lengths
from specray.engine.verify_shape import batch_rows, max_draft, padded_rows


@pytest.mark.parametrize("module", [verify_shape, shapes])
def test_docstring_examples(module):
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


def linear(n: int) -> float:  # 10 ms + 3 ms per extra row
    return 0.010 + 0.003 * (n - 1)


def test_every_decode_only_round_lands_in_the_bucket_set():
    buckets = (1, 2, 4, 8, 16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        real = [1 + int(k) for k in rng.integers(0, max_draft(buckets) + 1, n)]
        rows = padded_rows(real, buckets)
        assert len(set(rows)) == 1 and rows[0] in buckets  # one bucket for the whole batch
        assert all(p >= r for p, r in zip(rows, real)) and rows[0] == min(b for b in buckets if b >= max(real))


def test_prompt_rounds_are_priced_unpadded():
    assert batch_rows([5, 0], (1, 8), n_prompt=0) == 16
    assert batch_rows([5, 0], (1, 8), n_prompt=30) == 30 + 6 + 1


def test_config_validates_buckets():
    assert EngineConfig().shape_buckets is None  # exact shapes by default
    cfg = EngineConfig(verify_shape="bucketed", verify_buckets=(8, 1, 4, 4))
    assert cfg.shape_buckets == (1, 4, 8)
    assert EngineConfig.model_validate(cfg.model_dump()).shape_buckets == (1, 4, 8)  # through the target actor
    for bad in ((), (0, 4)):
        with pytest.raises(ValidationError):
            EngineConfig(verify_shape="bucketed", verify_buckets=bad)
    with pytest.raises(ValidationError, match="exceeds n_batch"):
        EngineConfig(verify_shape="bucketed", verify_buckets=(1, 64), n_batch=32)
    with pytest.raises(ValidationError):
        EngineConfig(verify_shape="padded")


def test_planner_fills_a_bucket_another_sequence_paid_for():
    # A's 4th token would move the round to bucket 8: the scan stops at A=3 (bucket 4, 8 rows), and B's first
    # token, ranked after A's 4th, fits the bucket A already pays for: it is sent for free
    rows = lambda lengths: batch_rows(lengths, (1, 2, 4, 8))  # noqa: E731
    probs = [np.array([0.99, 0.98, 0.97, 0.96, 0.1]), np.array([0.5])]
    assert plan_draft_lengths(probs, 2, linear, rows=rows) == [3, 1]
    assert plan_draft_lengths(probs, 2, linear) == [4, 0]  # unpadded pricing: a different cut


def test_padded_pricing_is_never_slower_than_plain_decoding():
    # the cost policy's promise under the option: the chosen drafts' expected tokens per second of the padded
    # batch are at least what no draft (also padded: buckets without 1) would give
    rng = np.random.default_rng(1)
    for buckets in ((1, 2, 4, 8, 16), (4, 8), (1, 16)):
        rows = lambda lengths, b=buckets: batch_rows(lengths, b)  # noqa: E731
        for _ in range(100):
            n = int(rng.integers(1, 5))
            probs = [np.sort(rng.random(int(rng.integers(0, 12))))[::-1] for _ in range(n)]
            lengths = plan_draft_lengths(probs, n, linear, rows=rows)
            gain = n + sum(float(np.minimum.accumulate(p)[:k].sum()) for p, k in zip(probs, lengths))
            assert gain / linear(rows(lengths)) >= n / linear(rows([0] * n)) * (1 - 1e-9)
            assert all(k <= len(p) for p, k in zip(probs, lengths))
