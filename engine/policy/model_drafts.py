"""Model drafts priced before they are made: which sequences a model speculator drafts for, and how long.

A model-free look-up costs microseconds; a draft model's costs decodes. So
under the cost policy a model speculator is asked last, and only for
sequences where its expected accepted tokens beat the best free draft and
the planner finds its draft time worth paying: the draft steps (shared among
the sequences drafting together) plus, per sequence, the catch-up of a draft
cache that lags (up to its whole prompt), spread over the rounds the
speculator is expected to keep drafting for it (catchup_price.py). Where no
draft pays, a 1-token draft now and then keeps its acceptance measured,
within a share of the round time (ChainConfig.model_explore).

>>> from specray.engine.policy.pricing import Pricing
>>> m = ModelDrafts()
>>> m.drafted("draft", 0.004, exploring=False); m.take_seconds(), m.take_seconds()
(0.004, 0.0)
"""

from __future__ import annotations

import numpy as np

from .catchup_price import SteadyShare, catchup_charge
from .estimates import ValueEstimates
from .planner import plan_draft_lengths
from .pricing import Pricing, draft_value
from .proposal import SeqDraftRequest

#: exploring time a model speculator may save up (seconds): enough for a long prompt's catch-up
EXPLORE_BUDGET_CAP = 2.0


class ModelDrafts:
    """What the policy keeps per model speculator: the share of its drafts sent (catch-up pricing), its
    exploring budget and its draft time since the round pricer last took it."""

    def __init__(self) -> None:
        self.steady = SteadyShare()
        self.explore_budget: dict[str, float] = {}  # model speculator -> seconds it may spend exploring
        self._seconds = 0.0

    def drafted(self, name: str, seconds: float, exploring: bool) -> None:
        """`name` drafted for `seconds`; an exploring draft is charged what it took, not what it was priced at."""
        self._seconds += seconds
        if exploring:
            self.explore_budget[name] -= seconds

    def take_seconds(self) -> float:
        """Seconds model speculators drafted since the last call (then 0): priced as theirs, not the host's."""
        s, self._seconds = self._seconds, 0.0
        return s

    def price(self, name: str, spec, idx: list[int], requests: list[SeqDraftRequest], best_score: list[float],
              pricing: Pricing, estimates: ValueEstimates) -> tuple[dict[int, int], bool]:
        """Which of the requests `idx` model speculator `spec` drafts for this round, and how many tokens each.

        Returns ({request index: n_max}, exploring): exploring is True when the only draft chosen is the
        1-token one that keeps measuring the model's acceptance; its time is then charged to the exploring
        budget (`drafted`)."""
        cands: list[int] = []
        probs: list[np.ndarray] = []
        for i in idx:
            _, pp = estimates.estimate(name, requests[i].seq_id, min(requests[i].n_max, spec.max_steps))
            if len(pp) and draft_value(pp, pricing) > best_score[i]:
                cands.append(i)
                probs.append(pp)
        if not cands:
            return {}, False
        share = spec.draft_seconds(len(cands), max(len(p) for p in probs)) / len(cands)
        catchup = [spec.catchup_seconds(requests[i].seq_id, requests[i].history_for(spec)) for i in cands]
        extra = [share + catchup_charge(c, requests[i].tokens_left, float(pp.sum()), self.steady.share(name))
                 for i, pp, c in zip(cands, probs, catchup)]
        lengths = plan_draft_lengths(probs, pricing.base_tokens, pricing.cost, n_decoding=pricing.n_decoding,
                                     extra_seconds=extra)
        # a draft cut this short must still beat the free one, or its time is wasted
        chosen = {i: k for i, k, pp in zip(cands, lengths, probs)
                  if k > 0 and draft_value(pp[:k], pricing) > best_score[i]}
        exploring = False
        if not chosen and pricing.explore > 0:
            # keep measuring the model's acceptance, within a time budget: each round saves `explore` x its
            # plain decode time; a 1-token draft (the cheapest catch-up of the candidates, the draft step and
            # its verify row) is made once the savings cover it. Exploring thus costs at most that share of
            # the time, however long the catch-up (a whole prompt for a sequence never drafted)
            base = pricing.cost(pricing.base_tokens)
            budget = min(EXPLORE_BUDGET_CAP, self.explore_budget.get(name, 0.0) + pricing.explore * base)
            j = min(range(len(cands)), key=lambda c: catchup[c])
            price = catchup[j] + spec.draft_seconds(1, 1) + pricing.cost(pricing.base_tokens + 1) - base
            if price <= budget:
                chosen = {cands[j]: 1}
                budget -= pricing.cost(pricing.base_tokens + 1) - base  # the verify row; drafted() charges the rest
                exploring = True
            self.explore_budget[name] = budget
        return chosen, exploring
