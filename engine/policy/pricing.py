"""What a round's time is worth in tokens, and what a draft is worth against it.

`Pricing` is one round's price curve: the seconds of a target decode of n
rows (decode plus host work, RoundPricer.price), the rows the round holds
without drafts and the sequences that emit a token anyway. From it,
`draft_value` says how many tokens a draft wins net of its verify time, the
quantity the cost policy ranks drafts by.

>>> p = Pricing(cost=lambda n: 0.010 + 0.005 * (n - 1), base_tokens=1, n_decoding=1)
>>> [round(t, 3) for t in p.time_in_tokens_list(3)]   # 1, 2, 3 more rows cost half a token each
[0.5, 1.0, 1.5]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Pricing:
    """What a round costs, for pricing model drafts before they are made (cost policy)."""

    cost: Callable[[int], float]  # seconds of a target decode of n tokens
    base_tokens: int  # tokens the round's target batch holds without drafts
    n_decoding: int  # sequences that emit a token this round anyway
    # share of the round time a model speculator may spend on drafts the price rules out (1 token, catch-up
    # included), so its acceptance keeps being measured (ChainConfig.model_explore); saved up, then spent
    explore: float = 0.0
    _seconds_per_token: float | None = field(default=None, init=False, repr=False)
    _time_list: list[float] = field(default_factory=list, init=False, repr=False)

    def seconds_per_token(self) -> float:
        """The round's plain decode time per sequence that emits a token (what a token is worth, in seconds;
        memoised: the look-up gate asks for it once per speculator, every round)."""
        if self._seconds_per_token is None:
            self._seconds_per_token = self.cost(self.base_tokens) / max(1, self.n_decoding)
        return self._seconds_per_token

    def time_in_tokens(self, n: int) -> np.ndarray:
        """[k-1]: tokens the round's plain rate would emit in the time k more verify rows take, k = 1..n
        (memoised: every draft of the round is priced with the same curve). Empty if the round is free."""
        return np.array(self.time_in_tokens_list(n), dtype=np.float64)

    def time_in_tokens_list(self, n: int) -> list[float]:
        """time_in_tokens(n) as Python floats, memoised for the round (empty if the round is free). Python, not
        numpy: a new Pricing every round computes it for its first draft, where numpy's per-call overhead outweighs
        the arithmetic."""
        if len(self._time_list) < n:
            base = self.cost(self.base_tokens)
            if base <= 0:
                return []
            per = self.n_decoding / base
            self._time_list = [(self.cost(self.base_tokens + k) - base) * per for k in range(1, n + 1)]
        return self._time_list[:n]


def draft_value(prefix_probs: np.ndarray, pricing: Pricing | None) -> float:
    """What a draft is worth to its sequence, in tokens: expected accepted tokens of its best prefix minus
    the tokens the round's extra verify time would have produced at the round's plain rate. Without
    pricing, expected accepted tokens of the whole draft. The cost policy picks the draft worth most,
    so a long draft of shaky tokens does not beat a short sure one.

    >>> pp = np.array([0.9, 0.8, 0.3])
    >>> round(draft_value(pp, None), 2)
    2.0
    >>> flat = Pricing(cost=lambda n: 0.010 + 0.005 * (n - 1), base_tokens=1, n_decoding=1)
    >>> round(draft_value(pp, flat), 2)   # 2 tokens: 1.7 expected - 2 x 0.5 tokens of time
    0.7
    """
    n = len(prefix_probs)
    if n == 0:
        return 0.0
    # numpy's cumsum and max in Python floats (bitwise the same): 1-8 tokens, every draft scored, every round
    probs = prefix_probs.tolist() if isinstance(prefix_probs, np.ndarray) else [float(p) for p in prefix_probs]
    time = pricing.time_in_tokens_list(n) if pricing is not None else ()
    gain, best = 0.0, -math.inf
    for j, p in enumerate(probs):
        gain += p
        if time:
            best = max(best, gain - time[j])
    return gain if not time else max(0.0, best)


def judged_worth(m: int, worth: float | None, rows_price: np.ndarray | None) -> bool:
    """Whether a draft whose first `m` tokens were right counts as winning them for the look-up gate
    (lookup_gate.py). A probe's (rows_price: the time of 1..k verify rows, in tokens) in hindsight: its m
    right tokens beat their rows' time. Any other: the cost policy found a prefix worth sending (worth > 0), or
    did not price it (None).

    >>> judged_worth(3, 0.0, np.array([0.2, 0.4, 0.6]))   # a probe: 3 right tokens for 0.6 tokens of time
    True
    >>> judged_worth(1, 0.0, np.array([1.0, 2.0])), judged_worth(0, 0.0, np.array([0.1]))   # a whole decode a row
    (False, False)
    >>> judged_worth(2, 0.0, None), judged_worth(2, 0.4, None), judged_worth(2, None, None)
    (False, True, True)
    """
    if rows_price is not None:
        return m > 0 and (len(rows_price) == 0 or bool(m > rows_price[min(m, len(rows_price)) - 1]))
    return worth is None or worth > 0
