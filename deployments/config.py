"""The deployment's one config: engine, deployment mode, resources, HTTP.

A YAML file holds the same fields as `ServeConfig` (unknown keys are errors):

    mode: distributed
    engine:
      model: smollm2-135m
      slots: 8
      chain: {speculators: [ngram_mod, suffix], n_max: 16}
    target_cpus: 0.5

`load_serve_config(dict)` also understands `config_file: PATH` (the file is
loaded first, the other keys override it, nested dicts merged key by key);
that is how `serve run cluster/serve-local.yaml` passes its `args:`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specray.engine.config import EngineConfig

from specray.deployments.ab.arms import ArmConfig
from specray.deployments.models.config import ServedModel

Mode = Literal["colocated", "distributed"]

#: the CLI's default: on a small CPU box the actor hop is pure overhead (see the report in
#: tests/serve and `GET /v1/stats` -> hop); `distributed` is the cluster / GPU shape.
DEFAULT_MODE: Mode = "colocated"


Layout = Literal["fused", "split"]

#: the default serving layout (docs/serving.md: the layouts, and how `specray bench --url` compares them)
DEFAULT_LAYOUT: Layout = "fused"


#: extra environment of the engine processes; none by default (see worker_env)
DEFAULT_WORKER_ENV: dict[str, str] = {}


class ServeConfig(BaseModel):
    """Everything `specray serve` / `build_app` need to deploy the app."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig, description="the engine (target, slots, chain)")
    mode: Mode = Field(
        DEFAULT_MODE,
        description="colocated: target context in the router replica's process; distributed: target (and "
        "companion) in their own Ray actors, in the replica's placement group",
    )
    target_hop: Literal["auto", "actor", "compiled"] = Field(
        "auto",
        description="distributed: how each round reaches the target actor. actor: one actor call a round; "
        "compiled: a Ray Compiled Graph (shared-memory channels, no task submission per round; "
        "deployments/actors/target_channel.py), whose channels poll a core; auto: compiled where the target's "
        "node has a core its threads leave free or the target decodes on a GPU, else actor (a polling channel "
        "without a free core takes CPU from the decode)",
    )
    companion_hop: Literal["auto", "actor", "compiled"] = Field(
        "auto",
        description="distributed: how each round's draft call reaches the companion actor (draft model, mtp, "
        "eagle3, dflash), as target_hop: actor, compiled, or auto: compiled where the node has a core beyond the "
        "target's and the companion's threads or the target decodes on a GPU, else actor",
    )
    app_name: str = Field("specray", description="Serve application name")
    route_prefix: str = Field("/", description="HTTP route prefix of the app")
    host: str = Field("127.0.0.1", description="HTTP bind address (specray serve; serve run uses http_options)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (specray serve)")
    served_model_name: str | None = Field(None, description="model id in /v1/models and responses (default: engine.model)")

    layout: Layout = Field(
        DEFAULT_LAYOUT,
        description="fused: with one arm, the engine replica deployment serves HTTP itself (a token goes round "
        "thread -> replica event loop -> Serve's proxy: one process and handle hop fewer than split; "
        "docs/serving.md); split: an Ingress deployment in front of the engine deployment (one more process and Serve "
        "handle hop per token; ingress_replicas / ingress_cpus apply). Several arms or autoscaling are always "
        "split (the Ingress routes between the arms' deployments and keeps the request records of replicas "
        "that scale away)",
    )
    direct_ingress: bool | None = Field(
        None,
        description="specray serve only: the app's ingress replica (fused: the engine replica) listens on `port` "
        "itself (Ray Serve's direct ingress, RAY_SERVE_ENABLE_DIRECT_INGRESS), so no HTTP proxy process "
        "handles the requests; Serve's proxy moves to another port. Needs a Ray that specray serve starts (the "
        "setting is in Ray's processes' environment) and one ingress replica (Serve gives each its own port). "
        "None (the default): on exactly where those hold (a local Ray, one ingress replica), as a token then skips "
        "the proxy process's hop",
    )
    num_replicas: int = Field(1, ge=1, description="engine replicas (ignored when autoscaling is set)")
    autoscaling: dict[str, Any] | None = Field(
        None, description="passed as is to Serve's autoscaling_config of the engine replica deployment"
    )
    max_ongoing_requests: int = Field(64, ge=1, description="requests in flight per engine replica (streams count)")
    ingress_max_ongoing_requests: int = Field(256, ge=1, description="requests in flight per ingress replica")
    ingress_replicas: int = Field(1, ge=1)

    ingress_cpus: float = Field(0.1, ge=0, description="Ray CPUs of an ingress replica")
    replica_cpus: float = Field(0.25, ge=0, description="Ray CPUs of an engine replica (router)")
    target_cpus: float = Field(0.5, ge=0, description="Ray CPUs of the target actor (distributed)")
    target_gpus: float = Field(0, ge=0, description="Ray GPUs of the target actor (distributed, GPU clusters)")
    companion_cpus: float = Field(0.1, ge=0, description="Ray CPUs of the companion actor (distributed)")
    companion_gpus: float = Field(0, ge=0)
    colocated_gpus: float = Field(0, ge=0, description="Ray GPUs of the engine replica in colocated mode")
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each engine replica asks for (its own bundle, or its actor in colocated "
        "mode). Give every node {'specray_replica': 1} (ray start --resources) and set this to the same: no two "
        "replicas share a node, so losing a node loses one replica (cluster/serve-cluster.yaml)")
    ingress_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each ingress replica (split layout) asks for. On a cluster, "
        "{'node:__internal_head__': 0.001} keeps the ingress on the head node, which no engine replica shares: a lost "
        "worker node then takes engine replicas only, and the ingress answers their streams with a clean 503")
    user_code_loop: Literal["shared", "separate"] = Field(
        "shared",
        description="where Ray Serve runs the HTTP-serving replica's async code (the fused engine replica, the split "
        "layout's ingress and engine replicas). shared: on Ray's own event loop (sets "
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 in that process), so a streamed chunk wakes one thread instead "
        "of two, which saves serving CPU per token that small nodes would otherwise take from llama.cpp's decode "
        "(`specray bench --url` shows it as srv cpu; docs/serving.md). separate: Serve's default, a second event "
        "loop thread that keeps Ray's loop free of user code. worker_env, if it sets the variable itself, wins")
    direct_writes: bool = Field(
        True,
        description="where the engine replica holds the client's connection itself (fused layout with direct "
        "ingress, plain HTTP/1.1): the round thread writes each plain streamed delta (no logprobs, tools, echo or "
        "n > 1) to the socket as an HTTP chunk, instead of waking the replica's event loop every round to do it, "
        "which saves serving CPU per token (docs/serving.md). A stream where a check fails (TLS, HTTP/1.0, "
        "another HTTP server, Serve's proxy in front) goes through the event loop, as with false")
    worker_env: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_WORKER_ENV),
        description="environment of the engine replica and actor processes (set before llama.cpp loads), e.g. "
        "OMP_WAIT_POLICY=passive (llama.cpp's OpenMP threads sleep at every barrier: faster when other processes "
        "keep the cores busy, much slower on an idle box) or active (spin: faster on dedicated cores); {} keeps "
        "libgomp's default (spin briefly, then sleep)",
    )

    # ---- A/B arms (deployments/ab/arms.py) ----------------------------------------------------------------
    arms: list[ArmConfig] = Field(
        default_factory=list, description="A/B arms, each its own engine deployment with its own chain, weight and "
        "scaling; empty = one implicit arm `default` with engine.chain")
    arm_salt: str = Field("specray", description="salt of the sticky user -> arm hash (change it to reshuffle users "
                          "for a new experiment)")
    freeze_gc: bool = Field(
        True, description="once an engine replica (an ingress replica, a target or companion actor) has started, "
        "freeze what start-up left "
        "out of Python's garbage collector (gc.freeze, as vLLM does): its full collections, which stop every "
        "stream of the process while they run, then walk only what serving made since. The cost: a start-up "
        "object that later becomes cyclic garbage is never freed. /v1/stats `process.gc` (the actors: `target.gc`, "
        "`companion.gc`) counts the collections")
    stats_max_records: int = Field(
        20000, ge=0, description="per-request records (timings, tokens, drafts) the ingress keeps per arm for "
        "/v1/stats and `specray ab-report` (the oldest are dropped; totals are kept regardless)")

    # ---- several models (deployments/models) ------------------------------------------------------------
    models: list[ServedModel] = Field(
        default_factory=list, description="the models of a multi-model app, routed by each request's `model` "
        "(id or alias); each sets its own engine, arms, placement and scaling over the app's settings. Empty: one "
        "model, the top-level engine's")
    default_model: str | None = Field(
        None, description="the model (id or alias) that answers a request without `model` (None: the first)")

    # ---- reliability: limits, auth, actor supervision ----------------------------------------------
    api_key: str | None = Field(
        None, repr=False, description="if set, every endpoint except /health needs `Authorization: Bearer <key>` "
        "(401 otherwise, before any model work); `specray serve --api-key` / $SPECRAY_API_KEY set it")
    max_body_bytes: int = Field(2 << 20, ge=1024, description="request bodies larger than this get 413")
    prompt_overflow: Literal["error", "truncate"] = Field(
        "error", description="a prompt that does not fit the context with max_tokens: error = 400; truncate = drop "
        "its oldest tokens to fit (the response's usage.truncated_prompt_tokens and the "
        "X-Specray-Prompt-Truncated header say how many)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) of 429 / 503 answers")
    max_queued_requests: int = Field(
        64, ge=-1, description="requests waiting in Serve for an engine replica beyond max_ongoing_requests before "
        "new ones get 503 (-1 = unbounded, Serve's default); the replica's own queue is engine.max_queue (429)")
    target_step_timeout_s: float = Field(
        120.0, gt=0, description="distributed: a round call to the target actor that takes longer counts as a hung "
        "actor (it is killed and recreated, its requests get 503)")
    actor_start_timeout_s: float = Field(300.0, gt=0, description="time a (re)started actor has to load its model")
    actor_ping_timeout_s: float = Field(10.0, gt=0, description="watchdog: a ping slower than this marks the actor down")
    watchdog_interval_s: float = Field(1.0, ge=0, description="watchdog ping period of the actors (0 = off)")
    actor_restart_attempts: int = Field(
        8, ge=1, description="restart attempts in a row (exponential backoff from 0.5 s) before an actor counts as "
        "failed and the replica reports itself unhealthy (Serve then replaces it)")
    companion_call_timeout_s: float = Field(
        10.0, gt=0, description="a companion call slower than this gives no drafts and restarts the companion")

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.target_hop == "compiled" and self.mode != "distributed":  # auto means nothing colocated
            raise ValueError("target_hop 'compiled' needs mode 'distributed' (colocated has no target actor to hop to)")
        if self.companion_hop == "compiled" and self.mode != "distributed":
            raise ValueError("companion_hop 'compiled' needs mode 'distributed' (colocated has no companion actor)")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")
        names = [a.name for a in self.arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm names must be unique, repeated: {dup}")
        if self.arms and sum(a.weight for a in self.arms) <= 0:
            raise ValueError("at least one arm needs a positive weight")
        if self.models or self.default_model:
            self._check_models()
        return self

    def _check_models(self) -> None:
        from specray.deployments.models.config import model_configs

        if not self.models:
            raise ValueError("default_model names a model of `models`, which is empty")
        if self.served_model_name:
            raise ValueError("served_model_name is the one-model app's id; with `models`, each model has its `id`")
        names = [n for m in self.models for n in [m.id, *m.aliases]]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model ids and aliases must be unique across models, repeated: {dup}")
        if self.default_model and self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not a model id or alias: {names}")
        for m in self.models:
            if m.split and (m.split.model not in names or m.split.model in [m.id, *m.aliases]):
                raise ValueError(f"model {m.id!r}: split.model {m.split.model!r} must name another model of "
                                 f"`models` ({names})")
        try:
            model_configs(self)
        except ValueError as e:
            raise ValueError(f"a model's own settings do not make a valid config: {e}") from None

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        m = self.engine.model
        return Path(m).stem if m.endswith(".gguf") else m

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ServeConfig:
        return load_serve_config({"config_file": str(path)})


def deep_merge(base: dict, override: dict) -> dict:
    """A copy of base with override's keys on top (nested dicts merged, the rest replaced)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


APP_IMPORT_PATH = "specray.deployments.app:build_app"


def read_yaml(path: str | os.PathLike) -> dict:
    """ServeConfig fields from a YAML file: a plain mapping of them, or a Serve config file
    (`serve run` / `serve deploy` format), whose specray application's `args` and
    `http_options` host/port are taken."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of ServeConfig fields, got {type(data).__name__}")
    if "applications" in data:
        apps = [a for a in data["applications"] or [] if a.get("import_path") == APP_IMPORT_PATH]
        if not apps:
            raise ValueError(f"{path}: a Serve config without an application of {APP_IMPORT_PATH}")
        app = apps[0]
        out = dict(app.get("args") or {})
        http = data.get("http_options") or {}
        for key in ("host", "port"):
            if key in http:
                out.setdefault(key, http[key])
        if app.get("name"):
            out.setdefault("app_name", app["name"])
        if app.get("route_prefix"):
            out.setdefault("route_prefix", app["route_prefix"])
        return out
    return data


def load_serve_config(args: dict | ServeConfig | None = None) -> ServeConfig:
    """ServeConfig from a dict (Serve app args) that may name a `config_file` to start from."""
    if isinstance(args, ServeConfig):
        return args
    args = dict(args or {})
    path = args.pop("config_file", None)
    base: dict = {}
    if path:
        base = read_yaml(path)
        nested = base.pop("config_file", None)
        if nested:
            raise ValueError(f"{path}: config_file cannot be nested")
    return ServeConfig.model_validate(deep_merge(base, args))
