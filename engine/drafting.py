"""One round's drafts: ask the chain for every decoding sequence, then cut them to what pays and fits.

Three cuts, in order: the chain's policy picks one draft per sequence (model
drafts are priced before they are made); under the cost policy the planner
cuts each to the length that maximises expected tokens per second; finally
all drafts together are scaled down to the batch's free rows. A speculator
that raises is disabled and the round goes on without drafts (never a lost
round): Chain.propose names the culprit on the exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from .chain import Chain, Pricing, Proposal, SeqDraftRequest
from .config import ChainConfig
from .planner import plan_draft_lengths

log = logging.getLogger("specray.scheduler")


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


def draft_round(chain: Chain, config: ChainConfig, reqs: list[SeqDraftRequest], room: int, base_tokens: int,
                price: Callable[[int], float], disabled: set[str], stats, explore_rng: np.random.Generator,
                rows: Callable[[list[int]], int] | None = None,
                fixed_seconds: list[float] | None = None) -> list[Proposal]:
    """The drafts of one round, one Proposal per request (empty where nothing pays or fits). `room`: draft rows
    the batch has left; `base_tokens`: rows it holds without drafts; `price(n)`: seconds of an n-row decode;
    `rows(lengths)`: the batch's rows for these draft lengths where they are padded (verify_shape.batch_rows).
    `fixed_seconds[s]`: what request s pays for sending any draft (a recurrent target's state save and expected
    rollback: rollback_price.py), or None.
    `disabled` collects speculators that failed; `stats` (RoundStats) counts draft time and failures."""
    if not any(r.chain and r.n_max > 0 for r in reqs) or room <= 0:
        return [Proposal(r.seq_id, None) for r in reqs]
    n_decoding = len(reqs)
    t0 = time.perf_counter()
    try:
        # model drafts are priced before they are made (cost policy): one is made only where its price model
        # expects it to beat no draft
        props = chain.propose(reqs, pricing=Pricing(price, base_tokens, n_decoding, config.model_explore))
    except Exception as e:  # degrade to plain decoding this round, disable the culprit for the next ones
        stats.speculator_failures += 1
        # Chain.propose tags the exception with the speculator that raised it; without the tag every round
        # would fail the same way and lose every sequence's draft, the other speculators' too
        culprit = getattr(e, "speculator", None)
        if culprit:
            disabled.add(culprit)
            log.exception("speculator %r failed while drafting; disabled (its sequences draft with the rest "
                          "of their chain)", culprit)
        else:
            log.exception("drafting failed (no speculator to blame); continuing without drafts this round")
        props = [Proposal(r.seq_id, None) for r in reqs]
    stats.draft_seconds += time.perf_counter() - t0
    if config.policy == "cost":
        lengths = plan_draft_lengths([p.prefix_probs for p in props], base_tokens, price, n_decoding=n_decoding,
                                     extra_seconds=fixed_seconds, rows=rows)
        for p, k in zip(props, lengths):
            if k == 0 and len(p.tokens) and config.explore and explore_rng.random() < config.explore:
                k = 1
            p.cut(k)
    for p, k in zip(props, fit_to_room([len(p.tokens) for p in props], room)):
        if k < len(p.tokens):
            p.cut(k)
    return props
