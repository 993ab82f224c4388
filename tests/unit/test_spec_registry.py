"""Registry of model-free speculators, and the modules' docstring examples."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
from pydantic import BaseModel

from specray.engine.speculator import DraftRequest, Speculator
from specray.engine.speculators.registry import SPECULATOR_TYPES, make_params, make_speculator

NAMES = {"ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "suffix", "grammar"}


def test_registered_names():
    assert set(SPECULATOR_TYPES) == NAMES
    for name, (params_cls, spec_cls) in SPECULATOR_TYPES.items():
        assert issubclass(params_cls, BaseModel) and issubclass(spec_cls, Speculator)
        assert spec_cls.name == name
        assert params_cls.model_config.get("extra") == "forbid"
        for field_name, f in params_cls.model_fields.items():
            assert f.description, f"{name}.{field_name} has no description"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_make_speculator_defaults_and_draft(name):
    sp = make_speculator(name, {"pool_size": 1024} if name == "ngram_mod" else None)
    assert sp.name == name and isinstance(sp.params, SPECULATOR_TYPES[name][0])
    (d,) = sp.draft([DraftRequest(0, np.arange(100, dtype=np.int32), 8)])
    assert d.dtype == np.int32 and len(d) == 0  # nothing repeats
    assert sp.stats.calls == 1


@pytest.mark.parametrize("bad", ["nope", "ngram-simple"])  # model speculators: test_*_speculator
def test_unknown_names(bad):
    with pytest.raises(ValueError) as e:
        make_speculator(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    assert all(n in msg for n in NAMES)


def test_invalid_params_name_speculator_and_field():
    with pytest.raises(ValueError) as e:
        make_speculator("ngram_map_k", {"size_n": 0})
    assert "ngram_map_k" in str(e.value) and "size_n" in str(e.value)
    with pytest.raises(ValueError) as e:
        make_speculator("suffix", {"p_minimum": 0.2})  # typo: extra fields are refused
    assert "suffix" in str(e.value) and "p_minimum" in str(e.value)


def test_params_instances_and_dicts():
    p = make_params("ngram_simple", {"size_n": 3})
    assert make_speculator("ngram_simple", p).params is p
    assert make_speculator("ngram_mod", {"n_match": 8, "pool_size": 64}).params.n_match == 8


@pytest.mark.parametrize(
    "mod",
    ["_util", "ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "suffix", "registry"],
)
def test_docstring_examples(mod):
    m = importlib.import_module(f"specray.engine.speculators.{mod}")
    res = doctest.testmod(m, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
