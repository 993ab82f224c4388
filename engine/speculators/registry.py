"""Model-free speculators by name (llama.cpp `--spec-type` names with underscores).

>>> spec = make_speculator("ngram_simple", {"size_n": 4})
>>> spec.name, spec.params.size_n
('ngram_simple', 4)
>>> make_speculator("nope")
Traceback (most recent call last):
...
ValueError: unknown speculator 'nope'; known: ngram_cache, ngram_map_k, ngram_map_k4v, ngram_mod, ngram_simple, suffix
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from specray.engine.speculator import Speculator

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
}


def make_params(name: str, params: dict[str, Any] | BaseModel | None = None) -> BaseModel:
    """Validate `params` for speculator `name`; ValueError names the speculator and the bad fields."""
    if name not in SPECULATOR_TYPES:
        raise ValueError(f"unknown speculator {name!r}; known: {', '.join(sorted(SPECULATOR_TYPES))}")
    params_cls, _ = SPECULATOR_TYPES[name]
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
    """A new speculator of type `name` with validated `params` (defaults if None)."""
    p = make_params(name, params)
    return SPECULATOR_TYPES[name][1](p)
