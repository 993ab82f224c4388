"""The companion actor: home of the model-based speculators (draft model, MTP, EAGLE-3).

None exist yet (issue 4); the actor is real and placed in the replica's
placement group, so the plumbing (placement, health, the per-round draft
call) is in place. The router calls `draft` once per round for every slot
only when the sequence's chain names a model-based speculator; model-free
chains never pay the hop.
"""

from __future__ import annotations

import os

import numpy as np
import ray

from specray.engine.config import EngineConfig

#: speculator names that run in the companion (none is implemented yet)
MODEL_SPECULATORS = frozenset({"draft", "mtp", "eagle3", "dflash"})

EMPTY = np.zeros(0, dtype=np.int32)


class CompanionService:
    def __init__(self, engine_config: dict | EngineConfig) -> None:
        self.config = EngineConfig.model_validate(engine_config)
        self.calls = 0

    def ping(self) -> str:
        return "ok"

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id(),
                "speculators": [], "model_speculators_known": sorted(MODEL_SPECULATORS)}

    def draft(self, requests: list) -> list[np.ndarray]:
        """One draft per request (SeqDraftRequest-like); empty until model speculators exist."""
        self.calls += 1
        return [EMPTY for _ in requests]

    def accept(self, updates: list) -> None:
        """Accepted tokens (+ hidden-row refs later) per sequence; nothing to do yet."""

    def counters(self) -> dict:
        return {"calls": self.calls}


CompanionActor = ray.remote(CompanionService)


def needs_companion(chain: tuple[str, ...] | list[str]) -> bool:
    return any(n in MODEL_SPECULATORS for n in chain)
