"""The draft vocabulary: the LM head keeps only the target tokens the data uses most (llama.cpp's `d2t`)."""

from __future__ import annotations

import numpy as np


def choose_draft_vocab(counts: np.ndarray, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` most frequent token ids (ties: the lower id first), with `always` (e.g. end-of-generation)
    included, sorted by id: draft row i is target token d2t[i].

    >>> choose_draft_vocab(np.array([5, 0, 9, 9, 1]), 3, always=(1,)).tolist()
    [1, 2, 3]
    """
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size must be in [1, {len(counts)}], got {size}")
    must = np.array(sorted(set(always)), dtype=np.int64)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then by id
    rest = order[~np.isin(order, must)][: max(0, size - len(must))]
    return np.sort(np.concatenate([must, rest]).astype(np.int64))


def to_draft_rows(d2t: np.ndarray, n_vocab: int) -> np.ndarray:
    """t2d [n_vocab]: a target token's draft row, -1 for tokens outside the draft vocabulary.

    >>> to_draft_rows(np.array([1, 3]), 5).tolist()
    [-1, 0, -1, 1, -1]
    """
    t2d = np.full(n_vocab, -1, dtype=np.int64)
    t2d[d2t] = np.arange(len(d2t))
    return t2d


def coverage(counts: np.ndarray, d2t: np.ndarray) -> float:
    """Share of the counted tokens the draft vocabulary holds (a draft can never propose the others).

    >>> coverage(np.array([5, 0, 9, 9, 1]), np.array([0, 2]))
    0.5833333333333334
    """
    total = counts.sum()
    return float(counts[d2t].sum() / total) if total else 0.0
