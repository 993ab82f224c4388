"""App builders: ServeConfig -> Serve application.

Two layouts (ServeConfig.layout): `split`, an Ingress deployment in front of
one engine deployment per A/B arm; `fused` (one arm at a fixed replica
count; several arms or autoscaling are always split), the arm's engine
deployment serving HTTP itself (deployments/fused.py), one process fewer on
every token's way out.

`build_app(args)` is the import path for Ray's own CLI:

    serve run cluster/serve-local.yaml        # applications[].import_path: specray.deployments.app:build_app
    serve run specray.deployments.app:build_app mode=distributed

`args` holds ServeConfig fields (nested dicts for `engine`), optionally
`config_file: PATH` to start from a YAML file.

Each arm (ServeConfig.arms; none declared = the one arm `default`, deployed as
`EngineReplica` as before arms) is its own deployment `EngineReplica-NAME`
with its own chain, replicas / autoscaling. What may change at run time is
in the deployments' `user_config`, which Serve applies without restarting
replicas (`serve deploy` with `deployments: [{name, user_config}]`):
the Ingress takes `{"weights": {ARM: WEIGHT}}`, an arm's engine
`{"chain": ChainConfig fields}` (fused: the one deployment takes both).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from specray.cluster.placement import STRATEGY, replica_bundles

from specray.deployments.ab.arms import ArmConfig, autoscaling_config, deployment_name, resolve_arms
from specray.deployments.fused import FusedReplica
from specray.deployments.http.ingress import Ingress
from specray.deployments.replica.deployment import EngineReplica
from specray.deployments.config import ServeConfig, load_serve_config
from specray.deployments.models.config import model_configs, model_deployments
from specray.deployments.layout import uses_fused  # noqa: F401  (re-exported)


#: Ray Serve's switch for a second event loop thread for user code (read when the replica process imports Serve)
USER_CODE_THREAD_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"


def serving_env(cfg: ServeConfig) -> dict[str, str]:
    """Environment of a process that serves HTTP or streams (engine replicas, the split layout's ingress):
    `user_code_loop` as Serve's variable, then `worker_env` (which may override it).

    >>> serving_env(ServeConfig())
    {'RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD': '0'}
    >>> serving_env(ServeConfig(user_code_loop="separate", worker_env={"OMP_WAIT_POLICY": "active"}))
    {'RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD': '1', 'OMP_WAIT_POLICY': 'active'}
    """
    return {USER_CODE_THREAD_ENV: "0" if cfg.user_code_loop == "shared" else "1"} | dict(cfg.worker_env)


def replica_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve options of the engine replica deployment for this config."""
    # beyond max_ongoing_requests Serve queues at the caller's handle: bounded, so overload is a 503, not a pile-up
    opts: dict[str, Any] = {"max_ongoing_requests": cfg.max_ongoing_requests,
                            "max_queued_requests": cfg.max_queued_requests}
    if cfg.autoscaling:
        # Serve's own default target (2 ongoing requests) would scale an 8-slot engine at a quarter load
        opts["autoscaling_config"] = autoscaling_config(cfg.autoscaling, cfg.engine.slots)
    else:
        opts["num_replicas"] = cfg.num_replicas
    env = {"runtime_env": {"env_vars": serving_env(cfg)}}
    if cfg.mode == "distributed":
        # one placement group per replica: [replica, target actor, companion actor], same node
        opts["ray_actor_options"] = {"num_cpus": cfg.replica_cpus} | env
        opts["placement_group_bundles"] = replica_bundles(
            cfg.replica_cpus, cfg.target_cpus, cfg.companion_cpus, cfg.target_gpus, cfg.companion_gpus
        )
        opts["placement_group_bundles"][0].update(cfg.replica_resources)  # one replica per node (if asked)
        opts["placement_group_strategy"] = STRATEGY
    else:
        actor: dict[str, Any] = {"num_cpus": cfg.replica_cpus} | env
        if cfg.colocated_gpus:
            actor["num_gpus"] = cfg.colocated_gpus
        if cfg.replica_resources:
            actor["resources"] = dict(cfg.replica_resources)
        opts["ray_actor_options"] = actor
    return opts


def arm_serve_config(cfg: ServeConfig, arm: ArmConfig) -> ServeConfig:
    """The config one arm's engine deployment runs with: the arm's chain, replicas and autoscaling."""
    return cfg.model_copy(update={
        "engine": cfg.engine.model_copy(update={"chain": arm.chain_config(cfg.engine.chain)}),
        "num_replicas": arm.num_replicas or cfg.num_replicas,
        "autoscaling": arm.autoscaling if arm.autoscaling is not None else cfg.autoscaling,
        "arms": [],
    })


def build_fused(cfg: ServeConfig, arm: ArmConfig) -> Application:
    """One arm, fused: the engine replica deployment serves HTTP itself (deployments/fused.py)."""
    acfg = arm_serve_config(cfg, arm)
    return FusedReplica.options(
        **replica_options(acfg),
        name=deployment_name(arm.name, explicit=bool(cfg.arms)),
        user_config={"chain": acfg.engine.chain.model_dump(mode="json"), "weights": {arm.name: arm.weight}},
        # the HTTP proxy calls this deployment: Serve's own 503 + Retry-After when its queue is full
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.retry_after_s or None),
    ).bind(cfg.model_dump(mode="json"), acfg.model_dump(mode="json"), arm.name, acfg.num_replicas)


def model_engines(mcfg: ServeConfig, names: list[str]) -> dict[str, Application]:
    """One model's engine deployments, {arm: bound EngineReplica}, named `names` in arm order
    (models.config.model_deployments: EngineReplica[-MODEL][-ARM])."""
    engines = {}
    for arm, name in zip(resolve_arms(mcfg), names, strict=True):
        acfg = arm_serve_config(mcfg, arm)
        opts = replica_options(acfg) | {"name": name,
                                        "user_config": {"chain": acfg.engine.chain.model_dump(mode="json")}}
        engines[arm.name] = EngineReplica.options(**opts).bind(acfg.model_dump(mode="json"), arm.name)
    return engines


def build_app_from_config(cfg: ServeConfig) -> Application:
    conf = cfg.model_dump(mode="json")
    if uses_fused(cfg):
        return build_fused(cfg, resolve_arms(cfg)[0])
    several = bool(cfg.models)
    names = model_deployments(cfg)
    engines = {mid: model_engines(mcfg, names[mid]) for mid, mcfg in model_configs(cfg).items()}
    return Ingress.options(
        user_config={"weights": {m: {a.name: a.weight for a in resolve_arms(c)} for m, c in model_configs(cfg).items()}
                     if several else {a.name: a.weight for a in resolve_arms(cfg)}},
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=cfg.ingress_max_ongoing_requests,
        # the HTTP proxy's queue in front of the ingress: bounded too (Serve answers 503 + Retry-After itself)
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.retry_after_s or None),
        ray_actor_options={"num_cpus": cfg.ingress_cpus, "runtime_env": {"env_vars": serving_env(cfg)}} | (
            {"resources": dict(cfg.ingress_resources)} if cfg.ingress_resources else {}),
    ).bind(engines, conf)


def build_app(args: dict | None = None) -> Application:
    """Serve app builder (`serve run ...:build_app`, `serve deploy`): args -> ServeConfig -> app."""
    return build_app_from_config(load_serve_config(args or {}))
