"""The head's labels: the target's top token at each position, and with `gen.soft_labels` K its K most
likely tokens with their probabilities (the head then learns the target's distribution, not only its
argmax: more to learn from each of the few positions a CPU budget can make; results: docs/experiments.md)."""

from __future__ import annotations

import numpy as np


def top_k_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, k], probabilities float32 [n, k]) of each row's k largest logits, most likely first;
    the probabilities are the full softmax's (they sum to less than 1 when k < vocabulary). The engine's
    top-n log-softmax (engine/logprobs.py, what `top_logprobs` answers with) does the work, a small cost next
    to the rows' prefill.

    >>> ids, p = top_k_probs(np.log(np.array([[0.1, 0.6, 0.3]], dtype=np.float32)), 2)
    >>> ids.tolist(), [round(float(x), 3) for x in p[0]]
    ([[1, 2]], [0.6, 0.3])
    """
    from specray.engine.logprobs import token_logprobs

    lp = token_logprobs(logits, np.zeros(len(logits), dtype=np.int64), k)
    return lp.top_ids, np.exp(lp.top_logprobs).astype(np.float32)


def soft_rows(ids: np.ndarray, p: np.ndarray, t2d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Soft labels as draft-vocabulary rows: (rows int64 [..., k], -1 off the draft vocabulary; weights
    float32 [..., k], 0 off it, renormalised to sum to 1 where any is on it).

    >>> rows, w = soft_rows(np.array([[5, 7, 9]]), np.array([[0.5, 0.3, 0.1]]), np.array([-1] * 7 + [0, -1, 1]))
    >>> rows.tolist(), [round(float(x), 3) for x in w[0]]
    ([[-1, 0, 1]], [0.0, 0.75, 0.25])
    """
    rows = t2d[ids].astype(np.int64)
    w = np.where(rows >= 0, p, 0.0).astype(np.float32)
    s = w.sum(-1, keepdims=True)
    return rows, np.divide(w, s, out=np.zeros_like(w), where=s > 0)
