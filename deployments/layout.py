"""Which serving layout a config deploys, decided without importing Ray Serve (`specray serve` must choose
direct ingress before Serve is imported: Serve reads that setting at import)."""

from __future__ import annotations

from specray.deployments.ab.arms import resolve_arms
from specray.deployments.config import ServeConfig


def uses_fused(cfg: ServeConfig) -> bool:
    """Whether this config deploys the fused layout: asked for, one model and one arm (the Ingress routes between
    the models' and arms' deployments) and a fixed replica count (under autoscaling the Ingress keeps the request records
    of engine replicas that scale away; fused, they would go with the replica)."""
    arms = resolve_arms(cfg)
    if cfg.layout != "fused" or len(arms) != 1 or cfg.models:
        return False
    return (arms[0].autoscaling if arms[0].autoscaling is not None else cfg.autoscaling) is None


def several_ingress_replicas(cfg: ServeConfig) -> str | None:
    """The setting that may start more than one ingress replica (fused: the engine replicas), or None."""
    if uses_fused(cfg):
        if (resolve_arms(cfg)[0].num_replicas or cfg.num_replicas) > 1:
            return "the fused engine deployment's num_replicas"
        return None
    return "ingress_replicas" if cfg.ingress_replicas > 1 else None
