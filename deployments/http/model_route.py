"""One served model as the ingress sees it: its arms' engine links, the A/B arm table, the request records.

The ingress holds one `ModelRoute` per model (deployments/models: a one-model app has one) and answers each
request through a `Pick`: which engine link serves it, which records count it, which arm and model id the
response names. A model's split (ModelDirectory.route) diverts a share of its requests to another model:
the other model's engine answers (and the response names that model), and the asking model's records count
it under the arm `@OTHER`, beside its own arms, so `specray ab-report --model` compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specray.deployments.ab.arms import ArmTable, resolve_arms
from specray.deployments.ab.stats import ArmRecords
from specray.deployments.models.directory import SPLIT_ARM_PREFIX


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
