"""One served model as the ingress sees it: its arms' engine links, the A/B arm table, the request records.

The ingress holds one `ModelRoute` per model (deployments/models: a one-model app has one) and answers each
request through a `Pick`: which engine link serves it, which records count it, which arm and model id the
response names. A model's split (ModelDirectory.route) diverts a share of its requests to another model:
the other model's engine answers (and the response names that model), and the asking model's records count
it under the arm `@OTHER`, beside its own arms, so `specray ab-report --model` compares them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from specray.deployments.ab.arms import ArmTable, resolve_arms
from specray.deployments.ab.stats import ArmRecords
from specray.deployments.models.directory import SPLIT_ARM_PREFIX

#: health statuses, best first: a model's (or app's) status is the worst of its parts'
HEALTH_ORDER = ("ok", "degraded", "recovering", "failed")


def worst(statuses) -> str:
    """The worst of some health statuses (an unknown one counts as worse than failed).

    >>> worst(["ok", "degraded"]), worst(["ok", "failed", "recovering"])
    ('degraded', 'failed')
    """
    return max(statuses, key=lambda st: HEALTH_ORDER.index(st) if st in HEALTH_ORDER else len(HEALTH_ORDER))


@dataclass(frozen=True)
class Pick:
    """Where one request goes: the engine link, the records that count it, the arm and model it is answered as."""

    engine: Any
    records: ArmRecords
    arm: str
    model: str


class ModelRoute:
    """A model's arms (deployments/ab/arms.py), their engine links and records. `cfg`: the model's own
    single-model ServeConfig (models.config.model_configs); `engines`: {arm: engine link}, in arm order."""

    def __init__(self, model_id: str, cfg, engines: dict, salt: str, max_records: int) -> None:
        self.id = model_id
        self.cfg = cfg
        self.engines = engines
        arms = resolve_arms(cfg)
        self.arms = ArmTable(arms, salt=salt)
        self.init_weights = {a.name: a.weight for a in arms}
        self.chains = {a.name: a.chain_config(cfg.engine.chain).label for a in arms}
        self.max_records = max_records
        self.records = {a.name: ArmRecords(max_records) for a in arms}
        self.first = self.engines[self.arms.names[0]]
        self.memory: dict | None = None
        #: why this model cannot serve now (its last health probe: no replica answered, or all failed); None: up
        self.down: str | None = None

    def pick(self, forced: str | None, key: str | None) -> Pick:
        """The arm for a request (ArmTable.pick; ValueError for an unknown forced arm)."""
        arm = self.arms.pick(forced, key)
        return Pick(self.engines[arm], self.records[arm], arm, self.id)

    def diverted(self, to: ModelRoute, key: str | None) -> Pick:
        """A request for this model that its split sends to `to`: `to`'s engine (its own arm choice), counted
        here under `@TO`."""
        arm = SPLIT_ARM_PREFIX + to.id
        if arm not in self.records:
            self.records[arm] = ArmRecords(self.max_records)
        inner = to.pick(None, key)
        return Pick(inner.engine, self.records[arm], arm, to.id)

    async def health(self, timeout_s: float) -> dict:
        """The model's health: its first arm's fields, the status the worst of its arms'; an arm whose engine
        does not answer within `timeout_s` (a deployment with no running replica queues the call) counts as
        failed. Sets `down` for the requests that follow."""
        per_arm: dict[str, dict] = {}
        for name, link in self.engines.items():
            try:
                per_arm[name] = await asyncio.wait_for(link.health(), timeout_s)
            except asyncio.TimeoutError:
                per_arm[name] = {"status": "failed",
                                 "error": f"no replica of the engine answered within {timeout_s:g} s"}
            except Exception as e:
                per_arm[name] = {"status": "failed", "error": f"unhealthy: {type(e).__name__}: {e}"}
        h = {"model": self.id} | per_arm[self.arms.names[0]]
        h["status"] = worst(a.get("status", "failed") for a in per_arm.values())
        if len(per_arm) > 1:
            h["arms"] = per_arm
        failed = [a.get("error", a.get("status")) for a in per_arm.values() if a.get("status") == "failed"]
        self.down = failed[0] if len(failed) == len(per_arm) else None
        return h

    async def target_memory(self) -> dict | None:
        """The model's target memory (attention, recurrent or hybrid; engine/rollback.py), asked once of its
        first arm's engine; None while it cannot answer (asked again next time)."""
        if self.memory is None:
            try:
                self.memory = (await self.first.health()).get("target_memory")
            except Exception:
                return None
        return self.memory

    def placement(self) -> dict:
        """What this model's replicas ask of the cluster (/v1/models)."""
        c = self.cfg
        scale = {"autoscaling": c.autoscaling} if c.autoscaling else {"num_replicas": c.num_replicas}
        gpus = {"target_gpus": c.target_gpus, "companion_gpus": c.companion_gpus} if c.mode == "distributed" else {
            "gpus": c.colocated_gpus}
        return {"mode": c.mode, "slots": c.engine.slots, "n_gpu_layers": c.engine.n_gpu_layers} | gpus | scale
