"""Speculators by name (llama.cpp `--spec-type` names with underscores), each declared once: `SPECULATORS`.

A `SpeculatorSpec` says everything the rest of specray needs to know about a
speculator. A model-free one is built from its parameters alone (`speculator`).
A model speculator (`draft`, `mtp`, `eagle3`, `dflash`) also needs a model:
whoever owns it (the co-located engine, the companion actor, the router's proxy
to it) passes a builder to `speculator_factory`, which gives the
`(name, params) -> Speculator` factory a `Chain` takes. Its entry says what it
needs (`needs`), the EngineConfig field that enables it (`config_field`) and
that field's declaration (`config`: engine/config.py builds the `draft` and
`hidden` sections from `config_fields`), the error when that is unset
(`missing`) and the command-line option(s) that set it (`cli`); its native
backend is `BACKEND` in native/NAME_backend.py (native/backends.BACKENDS[name]).

>>> spec = make_speculator("ngram_simple", {"size_n": 4})
>>> spec.name, spec.params.size_n
('ngram_simple', 4)
>>> make_speculator("nope")
Traceback (most recent call last):
...
ValueError: unknown speculator 'nope'; known: dflash, draft, eagle3, grammar, mtp, ngram_cache, ngram_map_k, ngram_map_k4v, ngram_mod, ngram_simple, suffix
>>> make_speculator("draft")
Traceback (most recent call last):
...
ValueError: speculator 'draft' needs a draft model: start with --draft-model PATH_OR_ALIAS (engine.draft.model)
>>> [s.name for s in model_speculators(hidden_rows=True)]
['mtp', 'eagle3', 'dflash']
>>> SPECULATORS["eagle3"].cli[0].dest, SPECULATORS["eagle3"].cli[0].config_path
('eagle3_model', ('hidden', 'eagle3_model'))
>>> list(config_fields("hidden").model_fields)
['mtp', 'eagle3_model', 'dflash_model']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo

from specray.engine.speculator import Speculator

from .dflash import DFlashParams
from .draft_base import DraftParams
from .eagle3 import Eagle3Params
from .grammar import GrammarParams, GrammarSpeculator
from .mtp import MtpParams
from .ngram_cache import NgramCacheParams, NgramCacheSpeculator
from .ngram_map_k import NgramMapKParams, NgramMapKSpeculator
from .ngram_map_k4v import NgramMapK4vParams, NgramMapK4vSpeculator
from .ngram_mod import NgramModParams, NgramModSpeculator
from .ngram_simple import NgramSimpleParams, NgramSimpleSpeculator
from .suffix import SuffixParams, SuffixSpeculator

#: what a model speculator can need beyond its parameters
NEEDS = ("model", "hidden_rows", "companion")
#: the EngineConfig sections whose enabling fields the registry declares (engine/config.py builds them from
#: `config_fields`): `hidden` for the speculators that read hidden rows, `draft` for the others
CONFIG_SECTIONS = ("draft", "hidden")
#: the parts only a model speculator has
_MODEL_PARTS = ("needs", "config_field", "config", "missing", "cli")


@dataclass(frozen=True)
class CliOption:
    """One command-line option that configures a model speculator: it sets EngineConfig at `config_path`.

    `metavar` None: a switch (store_true, default False); else an option taking a value (default None).

    >>> o = CliOption("--eagle3-model", ("hidden", "eagle3_model"), "EAGLE-3 draft GGUF", "PATH")
    >>> o.dest, o.switch, o.default
    ('eagle3_model', False, None)
    """

    flag: str
    config_path: tuple[str, ...]
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.metavar is None

    @property
    def default(self) -> bool | None:
        return False if self.switch else None


@dataclass(frozen=True)
class SpeculatorSpec:
    """One speculator, declared once.

    Model-free: `name`, `params` and `speculator` (built from its parameters alone). Model speculator
    (`speculator` None): `needs` (a subset of NEEDS, with "model"), `config_field` (the EngineConfig path
    `(section, field)` whose value enables it: section `hidden` if it reads hidden rows, else `draft`),
    `config` (that field's declaration, as pydantic's create_model takes it: `(type, Field(default,
    description=...))`), `missing` (what to say when it is named but not configured: its first option and
    config path) and `cli` (its options, the first setting `config_field`); its native backend is `BACKEND` in
    native/NAME_backend.py. An entry that lacks a part is refused when it is made, naming the part.

    >>> s = SPECULATORS["dflash"]
    >>> s.model, s.hidden_rows, s.config_field
    (True, True, ('hidden', 'dflash_model'))
    >>> SpeculatorSpec("lookahead", DraftParams, needs=("model",), config_field=("draft", "lookahead_model"))
    Traceback (most recent call last):
    ...
    ValueError: model speculator 'lookahead' lacks config, cli, missing (see SpeculatorSpec)
    """

    name: str
    params: type[BaseModel]
    speculator: type[Speculator] | None = None
    needs: tuple[str, ...] = ()
    config_field: tuple[str, ...] | None = None
    config: tuple[Any, FieldInfo] | None = None
    missing: str = ""
    cli: tuple[CliOption, ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            extra = [part for part in _MODEL_PARTS if getattr(self, part)]
            if extra:
                raise ValueError(f"model-free speculator {self.name!r} has model speculator parts: {', '.join(extra)}")
            return
        lacks = [part for part, ok in self._model_parts().items() if not ok]
        if lacks:
            raise ValueError(f"model speculator {self.name!r} lacks {', '.join(lacks)} (see SpeculatorSpec)")

    def _model_parts(self) -> dict[str, bool]:
        """Each part a model speculator must have -> whether this entry has it, well formed."""
        path = self.config_field or ()
        return {
            "needs": "model" in self.needs and set(self.needs) <= set(NEEDS),
            "config_field": len(path) == 2 and path[0] == ("hidden" if self.hidden_rows else "draft"),
            "config": bool(self.config) and isinstance(self.config[1], FieldInfo) and bool(self.config[1].description),
            "cli": bool(self.cli) and self.cli[0].config_path == path and all(o.help for o in self.cli),
            "missing": bool(self.missing) and all(
                o.flag in self.missing and f"engine.{'.'.join(o.config_path)}" in self.missing for o in self.cli),
        }

    @property
    def model(self) -> bool:
        """Needs a model (built through `speculator_factory`'s builders)."""
        return self.speculator is None

    @property
    def hidden_rows(self) -> bool:
        """Reads the target's hidden rows (the target outputs them; distributed, they travel to the companion)."""
        return "hidden_rows" in self.needs

    def config_value(self, engine_config) -> Any:
        """The value of this model speculator's config field in `engine_config` (an EngineConfig)."""
        section, field = self.config_field
        return getattr(getattr(engine_config, section), field)

    def enabled(self, engine_config) -> bool:
        """Whether `engine_config` (an EngineConfig) configures this model speculator."""
        return self.model and bool(self.config_value(engine_config))


def _model_free(params: type[BaseModel], cls: type[Speculator]) -> SpeculatorSpec:
    return SpeculatorSpec(cls.name, params, cls)


def _hidden_model_option(name: str, what: str, arch: str, extra: str = "") -> CliOption:
    return CliOption(f"--{name}-model", ("hidden", f"{name}_model"), metavar="PATH", help=(
        f"{what} draft GGUF trained for this target (architecture {arch}, with its own token embeddings and LM "
        f"head) for the `{name}` speculator{extra}; name `{name}` in the chain to use it"))


_SPECS = (
    _model_free(NgramSimpleParams, NgramSimpleSpeculator),
    _model_free(NgramMapKParams, NgramMapKSpeculator),
    _model_free(NgramMapK4vParams, NgramMapK4vSpeculator),
    _model_free(NgramModParams, NgramModSpeculator),
    _model_free(NgramCacheParams, NgramCacheSpeculator),
    _model_free(SuffixParams, SuffixSpeculator),
    # drafts only with the vocabulary an engine's builder passes it (deployments/builder.grammar_builders)
    _model_free(GrammarParams, GrammarSpeculator),
    SpeculatorSpec(
        "draft", DraftParams, needs=("model", "companion"), config_field=("draft", "model"),
        config=(str | None, Field(None, description="packaged alias or .gguf path of the draft model; None: no "
                                  "`draft`")),
        missing="a draft model: start with --draft-model PATH_OR_ALIAS (engine.draft.model)",
        cli=(CliOption("--draft-model", ("draft", "model"), metavar="PATH_OR_ALIAS", help=(
            "draft model for the `draft` speculator: packaged alias (smollm2-135m, gemma3-270m) or a .gguf path; "
            "name `draft` in the chain to use it")),)),
    SpeculatorSpec(
        "mtp", MtpParams, needs=("model", "hidden_rows", "companion"), config_field=("hidden", "mtp"),
        config=(bool, Field(False, description="load the target's own NextN (MTP) head for the `mtp` speculator "
                            "(the target GGUF must carry NextN layers: <arch>.nextn_predict_layers > 0)")),
        missing="the target's NextN (MTP) head: start with --mtp (engine.hidden.mtp) on a target whose GGUF has "
        "NextN layers",
        cli=(CliOption("--mtp", ("hidden", "mtp"), help=(
            "load the target's own NextN (multi-token prediction) head for the `mtp` speculator; the target GGUF "
            "must carry NextN layers (e.g. GLM-4.5, DeepSeek-V3, Qwen3.5, MiMo); name `mtp` in the chain to use "
            "it")),)),
    SpeculatorSpec(
        "eagle3", Eagle3Params, needs=("model", "hidden_rows", "companion"), config_field=("hidden", "eagle3_model"),
        config=(str | None, Field(None, description=".gguf path of an EAGLE-3 draft for this target (architecture "
                                  "eagle3) for the `eagle3` speculator; None: no `eagle3`")),
        missing="an EAGLE-3 draft model: start with --eagle3-model PATH (engine.hidden.eagle3_model)",
        cli=(_hidden_model_option("eagle3", "EAGLE-3", "eagle3"),)),
    SpeculatorSpec(
        "dflash", DFlashParams, needs=("model", "hidden_rows", "companion"), config_field=("hidden", "dflash_model"),
        config=(str | None, Field(None, description=".gguf path of a DFlash (or DFlash2) block-diffusion draft for "
                                  "this target (architecture dflash, with its own token embeddings and LM head) for "
                                  "the `dflash` speculator; None: no `dflash`")),
        missing="a DFlash draft model: start with --dflash-model PATH (engine.hidden.dflash_model)",
        cli=(_hidden_model_option("dflash", "DFlash (or DFlash2) block-diffusion", "dflash",
                                  ": one draft decode proposes a whole block per sequence"),)),
)

#: every speculator by name, in declaration order (model-free first, then the model speculators)
SPECULATORS: dict[str, SpeculatorSpec] = {s.name: s for s in _SPECS}

#: model-free speculators: name -> (parameters, class)
SPECULATOR_TYPES: dict[str, tuple[type[BaseModel], type[Speculator]]] = {
    s.name: (s.params, s.speculator) for s in _SPECS if not s.model}

#: speculators that need a model, by name -> their parameters (built through `speculator_factory`)
MODEL_SPECULATOR_PARAMS: dict[str, type[BaseModel]] = {s.name: s.params for s in _SPECS if s.model}


def model_speculators(hidden_rows: bool | None = None) -> tuple[SpeculatorSpec, ...]:
    """The model speculators in declaration order; `hidden_rows` True/False: only those that do/do not read
    the target's hidden rows."""
    return tuple(s for s in SPECULATORS.values()
                 if s.model and (hidden_rows is None or s.hidden_rows == hidden_rows))


def config_fields(section: str) -> type[BaseModel]:
    """A pydantic model of the enabling fields the model speculators declare in EngineConfig `section` (one of
    CONFIG_SECTIONS), in registry order: the base of that section's model in engine/config.py, so that a
    speculator's field is declared once, in its entry, and every config key stays where it was.

    >>> class Section(config_fields("draft")):
    ...     threads: int = 2
    >>> list(Section.model_fields), Section(model="m.gguf").model
    (['model', 'threads'], 'm.gguf')
    """
    if section not in CONFIG_SECTIONS:
        raise ValueError(f"no speculator declares fields in section {section!r}; sections: {CONFIG_SECTIONS}")
    fields = {s.config_field[1]: s.config for s in model_speculators() if s.config_field[0] == section}
    return create_model(f"{section.capitalize()}SpeculatorFields", __config__=ConfigDict(extra="forbid"),
                        **fields)


def enabled_speculators(engine_config, hidden_rows: bool | None = None) -> list[str]:
    """Names of the model speculators `engine_config` configures (as `model_speculators` for `hidden_rows`)."""
    return [s.name for s in model_speculators(hidden_rows) if s.enabled(engine_config)]


def cli_options(hidden_rows: bool | None = None) -> tuple[CliOption, ...]:
    """The command-line options of the model speculators (as `model_speculators` for `hidden_rows`)."""
    return tuple(o for s in model_speculators(hidden_rows) for o in s.cli)


def flag_values(args, section: str) -> dict[str, Any]:
    """The EngineConfig `section` fields the model speculators' options set, from parsed `args` (an option
    absent from `args`: its default).

    >>> import argparse
    >>> flag_values(argparse.Namespace(mtp=True, eagle3_model="e.gguf"), "hidden")
    {'mtp': True, 'eagle3_model': 'e.gguf', 'dflash_model': None}
    """
    return {o.config_path[1]: getattr(args, o.dest, o.default) for o in cli_options()
            if o.config_path[0] == section and len(o.config_path) == 2}


Builder = Callable[[BaseModel], Speculator]
Factory = Callable[[str, "dict[str, Any] | BaseModel | None"], Speculator]


def make_params(name: str, params: dict[str, Any] | BaseModel | None = None) -> BaseModel:
    """Validate `params` for speculator `name`; ValueError names the speculator and the bad fields."""
    if name not in SPECULATORS:
        known = sorted(SPECULATORS)
        raise ValueError(f"unknown speculator {name!r}; known: {', '.join(known)}")
    params_cls = SPECULATORS[name].params
    if isinstance(params, params_cls):
        return params
    if isinstance(params, BaseModel):
        params = params.model_dump()
    try:
        return params_cls.model_validate(params or {})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '<params>'}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(f"invalid parameters for speculator {name!r}: {problems}") from e


def make_speculator(name: str, params: dict[str, Any] | BaseModel | None = None) -> Speculator:
    """A new model-free speculator of type `name` with validated `params` (defaults if None)."""
    p = make_params(name, params)
    spec = SPECULATORS[name]
    if spec.model:
        raise ValueError(f"speculator {name!r} needs {spec.missing}")
    return spec.speculator(p)


def speculator_factory(builders: Mapping[str, Builder] | None = None) -> Factory:
    """A `Chain` factory: model-free speculators as make_speculator, model speculators from `builders`
    (name -> callable taking the validated parameters), e.g. {"draft": draft_model.speculator}."""
    builders = dict(builders or {})

    def factory(name: str, params: dict[str, Any] | BaseModel | None = None) -> Speculator:
        if name in builders:
            return builders[name](make_params(name, params))
        return make_speculator(name, params)

    return factory
