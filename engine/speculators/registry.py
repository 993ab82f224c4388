"""Speculators by name (llama.cpp `--spec-type` names with underscores).

Model-free speculators are built from their parameters alone. Model
speculators (`draft`) also need a model: whoever owns it (the co-located
engine, the companion actor, the router's proxy to it) passes a builder to
`speculator_factory`, which gives the `(name, params) -> Speculator` factory
a `Chain` takes.

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

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

SPECULATOR_TYPES: dict[str, tuple[type[BaseModel], type[Speculator]]] = {
    NgramSimpleSpeculator.name: (NgramSimpleParams, NgramSimpleSpeculator),
    NgramMapKSpeculator.name: (NgramMapKParams, NgramMapKSpeculator),
    NgramMapK4vSpeculator.name: (NgramMapK4vParams, NgramMapK4vSpeculator),
    NgramModSpeculator.name: (NgramModParams, NgramModSpeculator),
    NgramCacheSpeculator.name: (NgramCacheParams, NgramCacheSpeculator),
    SuffixSpeculator.name: (SuffixParams, SuffixSpeculator),
    # drafts only with the vocabulary an engine's builder passes it (deployments/builder.grammar_builders)
    GrammarSpeculator.name: (GrammarParams, GrammarSpeculator),
}

#: speculators that need a model, by name -> their parameters (built through `speculator_factory`)
MODEL_SPECULATOR_PARAMS: dict[str, type[BaseModel]] = {"draft": DraftParams, "mtp": MtpParams,
                                                        "eagle3": Eagle3Params, "dflash": DFlashParams}

#: what a model speculator needs that its parameters do not say
MODEL_NEEDS = {
    "draft": "a draft model: start with --draft-model PATH_OR_ALIAS (engine.draft.model)",
    "mtp": "the target's NextN (MTP) head: start with --mtp (engine.hidden.mtp) on a target whose GGUF has NextN layers",
    "eagle3": "an EAGLE-3 draft model: start with --eagle3-model PATH (engine.hidden.eagle3_model)",
    "dflash": "a DFlash draft model: start with --dflash-model PATH (engine.hidden.dflash_model)",
}

Builder = Callable[[BaseModel], Speculator]
Factory = Callable[[str, "dict[str, Any] | BaseModel | None"], Speculator]


def make_params(name: str, params: dict[str, Any] | BaseModel | None = None) -> BaseModel:
    """Validate `params` for speculator `name`; ValueError names the speculator and the bad fields."""
    if name in MODEL_SPECULATOR_PARAMS:
        params_cls = MODEL_SPECULATOR_PARAMS[name]
    elif name in SPECULATOR_TYPES:
        params_cls, _ = SPECULATOR_TYPES[name]
    else:
        known = sorted([*SPECULATOR_TYPES, *MODEL_SPECULATOR_PARAMS])
        raise ValueError(f"unknown speculator {name!r}; known: {', '.join(known)}")
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
    if name in MODEL_SPECULATOR_PARAMS:
        raise ValueError(f"speculator {name!r} needs {MODEL_NEEDS[name]}")
    return SPECULATOR_TYPES[name][1](p)


def speculator_factory(builders: Mapping[str, Builder] | None = None) -> Factory:
    """A `Chain` factory: model-free speculators as make_speculator, model speculators from `builders`
    (name -> callable taking the validated parameters), e.g. {"draft": draft_model.speculator}."""
    builders = dict(builders or {})

    def factory(name: str, params: dict[str, Any] | BaseModel | None = None) -> Speculator:
        if name in builders:
            return builders[name](make_params(name, params))
        return make_speculator(name, params)

    return factory
