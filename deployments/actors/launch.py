"""Start a replica's target and companion actors, supervised, in its placement group's bundles.

    actors = start_actors(serve_cfg, tag="app:replica", on_change=wake)
    parts = build_engine(serve_cfg.engine, actors=actors)     # deployments/builder.py

Both actors take their options (CPUs, GPUs, worker env, timeouts, restart
attempts) from the ServeConfig; inside a replica's placement group they go to
bundles TARGET_BUNDLE and COMPANION_BUNDLE (cluster/placement.py), STRICT_PACK
with the replica. Actor names are `{tag}:{role}:{generation}` in the
ACTOR_NAMESPACE namespace, which is what /v1/stats shows and tests kill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .companion_client import CompanionClient
from .supervisor import ActorSupervisor

#: Ray namespace of the named target / companion actors
ACTOR_NAMESPACE = "specray"


@dataclass
class Actors:
    target: ActorSupervisor
    companion: CompanionClient
    strategy: str | None  # "STRICT_PACK" inside a replica's placement group, None outside one

    def placement(self) -> dict:
        """Where the replica and its actors run (for /v1/stats)."""
        import ray

        rc = ray.get_runtime_context()
        t, c = self.target.info, self.companion.sup.info
        return {
            "strategy": self.strategy,
            "replica": {"placement_group_id": rc.get_placement_group_id(), "node_id": rc.get_node_id()},
            "target": {k: t.get(k) for k in ("placement_group_id", "node_id", "pid", "env", "gpu_ids", "n_gpu_layers",
                                          "gpu_split")},
            # the draft model's load and context settings as llama.cpp took them (None: no draft model)
            "companion": {k: c.get(k) for k in ("placement_group_id", "node_id", "pid", "gpu_ids")}
            | {"draft": (c.get("draft") or {}).get("settings")},
        }

    def close(self) -> None:
        self.target.close()
        self.companion.close_channel()  # a compiled graph goes before its actor
        self.companion.sup.close()


def start_actors(cfg, tag: str, on_change: Callable[[ActorSupervisor], None] | None = None) -> Actors:
    """Start (and wait for) the target and companion actors of one replica. `cfg`: a ServeConfig."""
    import ray

    from specray.cluster.placement import COMPANION_BUNDLE, TARGET_BUNDLE, actor_strategy

    from .companion import CompanionActor
    from .target import TargetActor

    engine = cfg.engine.model_dump()

    def actor_options(role: str, gen: int, cpus: float, gpus: float, bundle: int, **extra: Any) -> dict:
        opts: dict[str, Any] = {"num_cpus": cpus, "name": f"{tag}:{role}:{gen}", "namespace": ACTOR_NAMESPACE,
                                **extra}
        if cfg.worker_env:
            opts["runtime_env"] = {"env_vars": dict(cfg.worker_env)}
        if gpus:
            opts["num_gpus"] = gpus
        strategy = actor_strategy(bundle)
        if strategy is not None:
            opts["scheduling_strategy"] = strategy
        return opts

    def ready(handle, name: str) -> dict:
        return ray.get(handle.info.remote(), timeout=cfg.actor_start_timeout_s) | {"actor_name": name}

    def make_target(gen: int):
        # two calls at once: a ping or counters read must not wait behind a round
        opts = actor_options("target", gen, cfg.target_cpus, cfg.target_gpus, TARGET_BUNDLE, max_concurrency=2)
        return TargetActor.options(**opts).remote(engine, cfg.freeze_gc), opts["name"]

    def make_companion(gen: int):
        opts = actor_options("companion", gen, cfg.companion_cpus, cfg.companion_gpus, COMPANION_BUNDLE)
        return CompanionActor.options(**opts).remote(engine, cfg.freeze_gc), opts["name"]

    common = dict(max_attempts=cfg.actor_restart_attempts, on_change=on_change)
    target = ActorSupervisor("target", make_target, ready, **common)
    companion = ActorSupervisor("companion", make_companion, ready, **common)
    target.start()
    try:
        companion.start()
    except BaseException:
        target.close()
        raise
    strategy = "STRICT_PACK" if actor_strategy(TARGET_BUNDLE) is not None else None
    return Actors(target, CompanionClient(companion, timeout_s=cfg.companion_call_timeout_s), strategy)
