"""How many draft tokens each sequence sends this round: the cost-aware cut.

Every decoding sequence contributes one token to the round's target batch
anyway. A draft token at position j of sequence s is worth P_s(j), the
probability that it and every draft token before it are accepted. Sending
`extra` draft tokens makes the batch cost c(base + extra). The round yields
E = n_decoding + sum of the chosen P's tokens, in c(...) seconds, and we pick
the set of draft tokens with the highest E / c. Since P_s(j) falls with j,
the best set is a prefix of all candidates sorted by P; we scan every prefix
length (the cost curve need not be convex).

>>> import numpy as np
>>> cost = lambda n: 0.010 + 0.003 * (n - 1)   # 10 ms + 3 ms per extra token
>>> plan_draft_lengths([np.array([0.9, 0.8, 0.3])], base_tokens=1, cost=cost)
[2]
>>> plan_draft_lengths([np.array([0.2])], base_tokens=1, cost=cost)   # 0.2 < 3/10: not worth it
[0]

With shape-stable verifies the batch holds padded rows (verify_shape.batch_rows): a draft is priced by the
bucket it lands in, and tokens that fill the chosen bucket cost nothing more, so they are sent too:

>>> from specray.engine.verify_shape import batch_rows
>>> rows = lambda lengths: batch_rows(lengths, (1, 4, 8))
>>> plan_draft_lengths([np.array([0.9, 0.8, 0.3, 0.2, 0.1])], 1, cost, rows=rows)   # 1 + 3 rows = bucket 4
[3]
>>> plan_draft_lengths([np.array([0.3, 0.2, 0.1])], 1, cost, rows=rows)   # 0.6 tokens for 9 ms more: no
[0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np


def ranked_tokens(prefix_probs: Sequence[np.ndarray]) -> tuple[list[int], list[float], list[int]]:
    """Every candidate's draft tokens as (owner candidate, probability: the running minimum of its prefix
    probabilities) and their order by falling probability, ties in candidate and position order. Python floats:
    1-8 tokens a candidate, every round, where numpy's accumulate per candidate and a stable argsort cost more
    than the arithmetic (tests/unit/test_planner_fast.py holds it to that numpy formula).

    >>> ranked_tokens([np.array([0.9, 0.95, 0.3]), np.array([]), np.array([0.5])])
    ([0, 0, 0, 2], [0.9, 0.9, 0.3, 0.5], [0, 1, 3, 2])
    """
    owners: list[int] = []
    probs: list[float] = []
    for s, p in enumerate(prefix_probs):
        low = math.inf
        for v in (p.tolist() if isinstance(p, np.ndarray) else [float(x) for x in p]):
            low = min(low, v)
            probs.append(low)
            owners.append(s)
    return owners, probs, sorted(range(len(probs)), key=lambda i: -probs[i])


def plan_draft_lengths(
    prefix_probs: Sequence[np.ndarray],
    base_tokens: int,
    cost: Callable[[int], float],
    n_decoding: int | None = None,
    extra_seconds: Sequence[float] | None = None,
    rows: Callable[[list[int]], int] | None = None,
) -> list[int]:
    """Return how many draft tokens to keep per candidate.

    prefix_probs[s][j]: probability that draft tokens 0..j of candidate s are all
    accepted (non-increasing in j). base_tokens: tokens in the batch without any
    draft (one per decoding sequence plus prefill rows). n_decoding: sequences
    that emit a token this round anyway (default: len(prefix_probs)).
    extra_seconds[s]: a fixed cost paid only if candidate s sends >= 1 token
    (e.g. a model drafter's time); 0 for model-free speculators.
    rows(lengths): rows of the batch holding these draft lengths per candidate (one candidate per decoding
    sequence), priced instead of base_tokens + their sum: shape-stable verifies pad them (verify_shape.py).
    """
    n = len(prefix_probs)
    if n == 0:
        return []
    if n_decoding is None:
        n_decoding = n
    owners, probs, order = ranked_tokens(prefix_probs)
    if not probs:
        return [0] * n
    taken = [0] * n  # draft lengths of the prefix scanned so far (a candidate's tokens come in order)
    base_cost = cost(base_tokens if rows is None else rows(taken))
    best_rate = n_decoding / base_cost if base_cost > 0 else 0.0
    best_k = 0
    gain = float(n_decoding)
    fixed = 0.0
    started = [False] * n
    for k, idx in enumerate(order, start=1):
        s = owners[idx]
        gain += probs[idx]
        if extra_seconds is not None and not started[s]:
            fixed += extra_seconds[s]
            started[s] = True
        taken[s] += 1
        rate = gain / (cost(base_tokens + k if rows is None else rows(taken)) + fixed)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_k = rate, k
    lengths = [0] * n
    for idx in order[:best_k]:
        lengths[owners[idx]] += 1
    if rows is not None and extra_seconds is None:  # tokens that add no row (they fill a padded bucket) are free
        sizes = [len(p) for p in prefix_probs]
        for s in range(n):
            while lengths[s] < sizes[s] and rows(lengths[:s] + [lengths[s] + 1] + lengths[s + 1 :]) == rows(lengths):
                lengths[s] += 1
    return lengths


def row_worth(prefix_probs: Sequence, lengths: list[int], base_tokens: int, n_decoding: int,
              cost: Callable[[int], float], extra_seconds: Sequence[float] | None = None) -> float:
    """The chance a token must have to be worth one more row of the batch `plan_draft_lengths` chose
    (`lengths` per candidate): the rate it reached, tokens per second, times what one more row costs. A
    candidate whose best token falls below it cannot pay (a draft tree's branch is not even looked up then).

    >>> cost = lambda n: 0.010 + 0.003 * (n - 1)
    >>> round(row_worth([np.array([0.9, 0.8, 0.3])], [2], 1, 1, cost), 3)   # 2.7 tokens in 16 ms, a row 3 ms
    0.506
    """
    gain, fixed = float(n_decoding), 0.0
    for i, (p, k) in enumerate(zip(prefix_probs, lengths)):
        if k:
            gain += float(np.minimum.accumulate(np.asarray(p, dtype=float)[:k]).sum())
            fixed += extra_seconds[i] if extra_seconds is not None else 0.0
    n = base_tokens + sum(lengths)
    c = cost(n) + fixed
    return gain / c * (cost(n + 1) - cost(n)) if c > 0 else 0.0


def fit_to_room(lengths: list[int], room: int) -> list[int]:
    """Scale draft lengths down proportionally so they total at most `room` rows.

    >>> fit_to_room([8, 4, 0], 6)
    [4, 2, 0]
    >>> fit_to_room([3, 2], 10)
    [3, 2]
    """
    total = sum(lengths)
    if total <= room:
        return list(lengths)
    scale = room / total
    return [int(n * scale) for n in lengths]
