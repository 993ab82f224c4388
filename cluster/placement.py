"""Placement of one engine replica and its actors (Serve `placement_group_bundles`).

Distributed mode: every engine replica gets its own placement group,
STRICT_PACK so the router, target and companion share a node (hidden rows and
CUDA IPC handles stay local). Serve starts the replica in bundle 0; the replica
then starts its actors in bundles TARGET_BUNDLE and COMPANION_BUNDLE of
`ray.util.get_current_placement_group()`.
"""

from __future__ import annotations

REPLICA_BUNDLE = 0
TARGET_BUNDLE = 1
COMPANION_BUNDLE = 2
STRATEGY = "STRICT_PACK"


def _bundle(cpus: float, gpus: float = 0) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus:
        b["GPU"] = float(gpus)
    return b


def replica_bundles(
    replica_cpus: float, target_cpus: float, companion_cpus: float, target_gpus: float = 0, companion_gpus: float = 0
) -> list[dict[str, float]]:
    """Bundles [replica, target actor, companion actor] for one engine replica."""
    return [_bundle(replica_cpus), _bundle(target_cpus, target_gpus), _bundle(companion_cpus, companion_gpus)]


def actor_strategy(bundle_index: int):
    """Scheduling strategy for an actor created by the replica: its bundle of the replica's group.

    Outside a placement group (a replica deployed without bundles, tests) the
    actor is scheduled normally (None).
    """
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        return None
    if bundle_index >= pg.bundle_count:
        raise ValueError(
            f"the replica's placement group has {pg.bundle_count} bundles; bundle {bundle_index} is missing "
            "(placement_group_bundles must be [replica, target, companion])"
        )
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index)
