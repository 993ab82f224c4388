"""Which model answers a request: its `model` field (an id or an alias), else the default model, and a
model's split (an experiment that diverts a share of its requests to another model).

A one-model app (no `models` in its config) answers whatever `model` a request names, as it always has and as
llama-server does, so clients with a hard-coded model name keep working; a multi-model app answers an
unknown name with 404 `model_not_found`.

>>> from specray.deployments.config import ServeConfig
>>> d = ModelDirectory(ServeConfig(models=[{"id": "a", "aliases": ["small"]}, {"id": "b"}], default_model="b"))
>>> d.resolve("small"), d.resolve(None), d.resolve("a")
('a', 'b', 'a')
>>> d.resolve("gpt-9")
Traceback (most recent call last):
...
specray.deployments.replica.errors.NotFound: The model 'gpt-9' does not exist; this server has: a (small), b
"""

from __future__ import annotations

import random

from specray.deployments.ab.arms import sticky_point
from specray.deployments.replica.errors import NotFound

#: the arm name under which a model's stats list the requests its split diverted to another model
SPLIT_ARM_PREFIX = "@"


class ModelDirectory:
    """The app's model ids, aliases, default and splits (ServeConfig.models; one model without it)."""

    def __init__(self, cfg, rng: random.Random | None = None) -> None:
        from specray.deployments.models.config import model_configs

        self.ids = list(model_configs(cfg))
        self.aliases = {a: m.id for m in cfg.models for a in m.aliases}
        self.default = self.canonical(cfg.default_model) if cfg.default_model else self.ids[0]
        self.splits = {m.id: (self.canonical(m.split.model), m.split.share) for m in cfg.models if m.split}
        self.salt = f"{cfg.arm_salt}\x00model"
        self.any_name = not cfg.models
        self._rng = rng or random.Random()

    def canonical(self, name: str) -> str | None:
        """The id `name` (an id or an alias) stands for, or None."""
        return name if name in self.ids else self.aliases.get(name)

    def resolve(self, name: str | None) -> str:
        """The id of the model a request names (None or '': the default); NotFound (404, code
        model_not_found) for a name this app does not serve."""
        if not name or self.any_name:
            return self.default
        found = self.canonical(name)
        if found is None:
            raise NotFound(f"The model {name!r} does not exist; this server has: {self.listing()}",
                           param="model", code="model_not_found")
        return found

    def route(self, name: str | None, key: str | None = None) -> tuple[str, str]:
        """(the model asked for, the model that answers): the same unless the asked model's split diverts
        this request. Sticky: the same key always gets the same answer while the share stays."""
        asked = self.resolve(name)
        split = self.splits.get(asked)
        if split is None or split[1] <= 0:
            return asked, asked
        u = sticky_point(key, self.salt) if key else self._rng.random()
        return asked, split[0] if u < split[1] else asked

    def aliases_of(self, model_id: str) -> list[str]:
        return [a for a, m in self.aliases.items() if m == model_id]

    def listing(self) -> str:
        by_id: dict[str, list[str]] = {i: [] for i in self.ids}
        for alias, mid in self.aliases.items():
            by_id[mid].append(alias)
        return ", ".join(f"{i} ({', '.join(a)})" if a else i for i, a in by_id.items())
