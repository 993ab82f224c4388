"""Change a running replica's chain (speculators, parameters, policy, n_max) without restarting it.

Called on the router's round thread, between rounds (`RouterCore.call`), when
Serve hands the replica a new `user_config`. Speculators whose parameters
changed are rebuilt with the new ones; their counters carry over (so metrics
and /v1/stats stay monotonic) and their acceptance estimates start afresh.
Sequences already running on a rebuilt speculator go on with the new
instance, begun on their history so far (prompt + generated); output stays
lossless either way, since every draft is verified. New requests use the new
chain at once; queued ones keep the speculator names they were admitted with.

Model speculators (`draft`, ...) hold a model context: their parameters are
part of the replica's start-up config and cannot change here.
"""

from __future__ import annotations

from typing import Any

from specray.engine.acceptance import AcceptanceTracker
from specray.engine.config import ChainConfig
from specray.engine.speculators.draft_base import ModelSpeculator


def changed_speculators(chain, new: ChainConfig) -> list[str]:
    """Built speculators whose parameters differ under the new config."""
    old = chain.config
    return sorted(n for n in chain.instances if (old.params.get(n) or {}) != (new.params.get(n) or {}))


def apply_chain_config(core, new: ChainConfig) -> dict[str, Any]:
    """Swap `core`'s chain config for `new` (round thread only). Raises ValueError, changing nothing,
    for unknown speculators, bad parameters or a model speculator whose parameters changed."""
    chain, sched = core.chain, core.scheduler
    changed = changed_speculators(chain, new)
    models = [n for n in changed if isinstance(chain.instances[n], ModelSpeculator)]
    if models:
        raise ValueError(f"parameters of model speculators {models} cannot change at run time (restart the "
                         "deployment)")
    # build everything first: a bad name or parameter leaves the running chain untouched
    fresh = {}
    try:
        for name in changed:
            fresh[name] = chain._factory(name, new.params.get(name))
        for name in new.speculators:
            if name not in chain.instances:
                fresh[name] = chain._factory(name, new.params.get(name))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"chain update refused: {e}") from None

    resumed = 0
    for seq in list(sched.active.values()):
        for name in changed:
            if name not in seq.chain:
                continue
            old = chain.instances[name]
            try:
                old.end(seq.slot)
                chain.trackers[name].end(seq.slot)
            except Exception:  # the old instance is discarded anyway
                pass
            fresh[name].begin(seq.slot, seq.history_view().copy())
            resumed += 1
    for name, inst in fresh.items():
        if name in chain.instances:
            inst.stats = chain.instances[name].stats  # counters carry over
        chain.instances[name] = inst
        chain.trackers[name] = AcceptanceTracker()
        sched.disabled_speculators.discard(name)  # new parameters: give a failed speculator another chance
    chain.config = new
    sched.config = sched.config.model_copy(update={"chain": new})
    core.cfg = core.cfg.model_copy(update={"engine": sched.config})
    return {"chain": new.label, "rebuilt": changed, "resumed_sequences": resumed}
