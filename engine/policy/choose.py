"""Scoring the drafts a round's speculators made and keeping each sequence's best.

Under `cost` a draft scores its draft_value (expected accepted tokens of its
best prefix net of its verify time); under `expected`, its speculator's
acceptance rate times its length. Each scored draft's context (agreement with
the sequence's other drafts: estimates.draft_context) is settled here, once
every free speculator has drafted.
"""

from __future__ import annotations

import numpy as np

from ..speculator import blame
from .estimates import ValueEstimates, draft_context
from .pricing import Pricing, draft_value
from .proposal import Proposal


def score_drafts(estimates: ValueEstimates, props: list[Proposal], unscored: list[tuple[int, str]],
                 best_score: list[float], policy: str, pricing: Pricing | None, probing: set[str]) -> None:
    """Score the drafts in `unscored` ((proposal index, speculator) pairs; then empty it), keeping each
    proposal's best in it. `probing`: speculators asked this round as look-up gate probes (their drafts keep
    the price of their verify rows, judged in hindsight: pricing.judged_worth).

    >>> e = ValueEstimates()
    >>> p = Proposal(0, None, drafts={"a": np.array([1, 2], np.int32), "b": np.array([3], np.int32)},
    ...              contexts={"a": 0, "b": 0})
    >>> score_drafts(e, [p], [(0, "a"), (0, "b")], [-1.0], "cost", None, set())
    >>> p.speculator, p.tokens.tolist()   # the longer draft wins at equal per-token estimates, unpriced
    ('a', [1, 2])
    """
    for i, name in unscored:
        p = props[i]
        d = p.drafts[name]
        p.contexts[name] = draft_context(p.contexts[name], d, [o for n, o in p.drafts.items() if n != name])
        try:  # called from a model speculator's turn too: blame the draft's own speculator
            raw, pp = estimates.estimate(name, p.seq_id, len(d), p.contexts[name])
            score = (estimates.rate(name, p.seq_id) * len(d) if policy == "expected"
                     else draft_value(pp, pricing))
        except Exception as e:
            blame(e, name)
            raise
        if pricing is not None and policy == "cost":
            p.worth[name] = score
            if name in probing:
                p.rows_price[name] = pricing.time_in_tokens(len(d))
        if score > best_score[i]:
            best_score[i] = score
            p.speculator, p.tokens, p.prefix_probs, p.raw_probs = name, d, pp, raw
    unscored.clear()
