"""A/B arms: named speculator chains with traffic weights, and how a request picks one.

An arm is its own engine deployment (same model, its own chain and
autoscaling). The ingress assigns each request to an arm:

1. the `X-Specray-Arm` header forces one (any arm, weight 0 included);
2. a sticky key (the body's `user`, else the `X-Session-Id` header) is hashed
   with the config's `arm_salt` to a point u in [0, 1): the same key always
   lands on the same arm while the weights stay the same;
3. without a key, u is random per request.

u picks the arm whose slice of [0, 1) holds it (slices in arm order, sized by
normalised weight). A weight change moves only the keys in the slices whose
borders moved. Weights can change at run time (the ingress's `user_config`),
so they live in an `ArmTable`, not in the deployment's init arguments.
"""

from __future__ import annotations

import hashlib
import random
import re
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specray.engine.config import ChainConfig, Policy, parse_chain

#: the arm of a config that declares none (backward compatible: one engine deployment, as before arms)
DEFAULT_ARM = "default"
ARM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
#: request header forcing an arm; the response carries the same header naming the arm that served it
ARM_HEADER = "X-Specray-Arm"
SESSION_HEADER = "X-Session-Id"


class ArmConfig(BaseModel):
    """One arm of an A/B test: a chain (over the engine's chain), a traffic weight, its own scaling."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="arm name (letters, digits, _ . -): the X-Specray-Arm value and metric label")
    weight: float = Field(1.0, ge=0, allow_inf_nan=False,
                          description="traffic share (normalised over the arms); 0 = only reachable by header")
    chain: list[str] | None = Field(
        None, description="speculator names ('ngram_mod,suffix', 'none' = no speculation); None = engine.chain's")
    params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-speculator parameters, merged over engine.chain.params")
    policy: Policy | None = Field(None, description="draft selection policy (None = engine.chain's)")
    n_max: int | None = Field(None, ge=0, le=256, description="draft tokens per round at most (None = engine's)")
    trees: bool | None = Field(None, description="send draft trees (ChainConfig.trees; None = engine.chain's): "
                               "an arm with trees beside one without compares the two on the same traffic")
    num_replicas: int | None = Field(None, ge=1, description="engine replicas of this arm (None = num_replicas)")
    autoscaling: dict[str, Any] | None = Field(
        None, description="Serve autoscaling_config of this arm's deployment (None = the config's `autoscaling`)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not ARM_NAME_RE.match(v):
            raise ValueError(f"arm name {v!r}: use 1-63 letters, digits, '_', '.', '-' (starting with a letter "
                             "or digit)")
        return v

    @field_validator("chain", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return parse_chain(v) if isinstance(v, str) else v

    def chain_config(self, base: ChainConfig) -> ChainConfig:
        """The arm's full chain: the engine's chain with this arm's overrides on top."""
        d = base.model_dump()
        for name, p in self.params.items():  # per speculator: the arm's keys over the engine's
            d["params"][name] = {**d["params"].get(name, {}), **p}
        if self.chain is not None:
            d["speculators"] = self.chain
        if self.policy is not None:
            d["policy"] = self.policy
        if self.n_max is not None:
            d["n_max"] = self.n_max
        if self.trees is not None:
            d["trees"] = self.trees
        return ChainConfig.model_validate(d)


def parse_arm_flag(text: str) -> ArmConfig:
    """`--arm NAME=CHAIN[@WEIGHT]` -> ArmConfig ('fast=ngram_mod,suffix@1', 'base=none@0.5'); ValueError naming
    what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"--arm {text!r}: expected NAME=CHAIN[@WEIGHT], e.g. fast=ngram_mod,suffix@1")
    chain, at, weight = rest.rpartition("@") if "@" in rest else (rest, "", "")
    try:
        w = float(weight) if at else 1.0
    except ValueError:
        raise ValueError(f"--arm {text!r}: weight {weight!r} is not a number") from None
    try:
        return ArmConfig(name=name.strip(), chain=chain.strip(), weight=w)
    except ValueError as e:
        raise ValueError(f"--arm {text!r}: {e}") from None


def sticky_point(key: str, salt: str = "") -> float:
    """A stable point in [0, 1) for a sticky key (same key and salt -> same point, in every process)."""
    h = hashlib.blake2b(f"{salt}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def choose_arm(names: Sequence[str], weights: Sequence[float], u: float) -> str:
    """The arm whose weight slice of [0, 1) holds u (slices in arm order). Zero-weight arms are never chosen."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("no arm has a positive weight")
    bounds, acc = [], 0.0
    for w in weights:
        acc += w / total
        bounds.append(acc)
    i = bisect_right(bounds, u)
    while i < len(names) and weights[i] <= 0:  # only at u == a border, or float rounding at the top
        i += 1
    if i >= len(names):  # u rounded past the last border: the last arm with weight
        i = max(j for j, w in enumerate(weights) if w > 0)
    return names[i]


class ArmTable:
    """The ingress's arms and their current weights (changed at run time by reconfigure)."""

    def __init__(self, arms: Sequence[ArmConfig], salt: str = "", rng: random.Random | None = None) -> None:
        self.names = [a.name for a in arms]
        self.weights = [float(a.weight) for a in arms]
        self.salt = salt
        self._rng = rng or random.Random()
        check_weights(dict(zip(self.names, self.weights)))

    def set_weights(self, weights: dict[str, float]) -> None:
        """New weights for some or all arms (unknown names are errors; at least one must stay positive)."""
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown} in weights; known: {self.names}")
        new = [float(weights.get(n, w)) for n, w in zip(self.names, self.weights)]
        check_weights(dict(zip(self.names, new)))
        self.weights = new

    def pick(self, forced: str | None = None, key: str | None = None) -> str:
        """The arm for a request: forced (header) > sticky key > random by weight. ValueError for an unknown
        forced arm."""
        if forced is not None:
            if forced not in self.names:
                raise ValueError(f"unknown arm {forced!r}; known: {', '.join(self.names)}")
            return forced
        u = sticky_point(key, self.salt) if key else self._rng.random()
        return choose_arm(self.names, self.weights, u)

    def shares(self) -> dict[str, float]:
        total = sum(self.weights)
        return {n: w / total for n, w in zip(self.names, self.weights)}


def check_weights(weights: dict[str, float]) -> None:
    bad = {n: w for n, w in weights.items() if not (w >= 0) or w == float("inf")}
    if bad:
        raise ValueError(f"arm weights must be finite and >= 0, got {bad}")
    if weights and sum(weights.values()) <= 0:
        raise ValueError("at least one arm needs a positive weight")


def resolve_arms(cfg) -> list[ArmConfig]:
    """A ServeConfig's arms, or the implicit arm `default` (engine.chain, weight 1) when it declares none."""
    return list(cfg.arms) or [ArmConfig(name=DEFAULT_ARM)]


def deployment_name(arm: str, explicit: bool, model: str | None = None) -> str:
    """Serve deployment name of an arm's engine: `EngineReplica` for the implicit default arm (as before
    arms existed), `EngineReplica-NAME` otherwise; in a multi-model app the model comes first.

    >>> deployment_name("default", False), deployment_name("fast", True), deployment_name("fast", True, "gemma")
    ('EngineReplica', 'EngineReplica-fast', 'EngineReplica-gemma-fast')
    """
    parts = ["EngineReplica"] + ([model] if model else []) + ([arm] if explicit else [])
    return "-".join(parts)


def default_autoscaling(slots: int) -> dict[str, Any]:
    """Serve autoscaling defaults for an LLM engine replica: the signal is ongoing requests per replica
    against the replica's slots (a replica whose slots are all busy and has requests waiting is full)."""
    return {"target_ongoing_requests": slots}


def autoscaling_config(user: dict[str, Any] | None, slots: int) -> dict[str, Any] | None:
    """The autoscaling_config an arm's deployment gets: the user's, with the LLM default filled in."""
    if not user:
        return None
    return default_autoscaling(slots) | dict(user)
