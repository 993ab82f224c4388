"""plan_draft_lengths ranks the draft tokens in Python floats (planner.ranked_tokens): owners, running minima
and order must be those of the numpy formula it replaced, ties included."""

from __future__ import annotations

import numpy as np

from specray.engine.policy.planner import ranked_tokens


def _numpy_ranked(prefix_probs):
    """The numpy version as it was: np.minimum.accumulate per candidate, then a stable argsort."""
    owners, probs = [], []
    for s, p in enumerate(prefix_probs):
        p = np.minimum.accumulate(np.asarray(p, dtype=np.float64)) if len(p) else p
        owners.extend([s] * len(p))
        probs.extend(p.tolist() if len(p) else [])
    return owners, probs, np.argsort(-np.asarray(probs), kind="stable").tolist()


def test_ranked_tokens_equal_the_numpy_formula():
    rng = np.random.default_rng(5)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        # few distinct values (ties within and across candidates), some rising (the running minimum acts),
        # some candidates without a draft; float32 rows too (what a tracker may hand over)
        probs = [np.round(rng.uniform(0.0, 1.0, int(rng.integers(0, 9))), 1).astype(
            np.float32 if rng.random() < 0.2 else np.float64) for _ in range(n)]
        assert ranked_tokens(probs) == _numpy_ranked(probs), probs
    assert ranked_tokens([]) == ([], [], []) and ranked_tokens([np.zeros(0)]) == ([], [], [])
