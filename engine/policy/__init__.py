"""The draft policy: what a round's drafts are worth, which are sent, and how much of each.

One entry point, `DraftPolicy.plan_round`, called by the scheduler once per
round (policy.py). The modules, by what they decide:

- proposal.py: the per-sequence request and the chosen draft (`SeqDraftRequest`, `Proposal`);
- pricing.py: a round's price curve in tokens, and a draft's net value (`Pricing`, `draft_value`);
- round_price.py, host_cost.py, rollback_price.py: what a round costs, learnt from live rounds
  (the decode's model is engine/cost.py, shared with the speculators that price their own steps);
- estimates.py, acceptance.py, calibration.py: each speculator's acceptance estimate (estimates made in
  _estimate_core.c where it is built);
- lookup_gate.py: whether a speculator's look-ups pay for themselves;
- model_drafts.py, catchup_price.py: model drafts priced before they are made;
- tuning.py, tuning_shadow.py: online tuning of look-up parameters;
- choose.py: the best draft per sequence; planner.py: the cost-aware cut and the fit to the batch.

The chain (engine/chain.py) holds the speculators and makes the look-ups it is asked for; it decides nothing.
"""

from .policy import DraftPolicy, Room
from .proposal import Proposal, SeqDraftRequest

__all__ = ["DraftPolicy", "Proposal", "Room", "SeqDraftRequest"]
