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


# ---- every speculator declared once: the registry entry, its native backend, its options ----------------------

MODEL_NAMES = {"draft", "mtp", "eagle3", "dflash"}


def _engine_field(path: tuple[str, ...]):
    """The pydantic field of EngineConfig at `path` (AssertionError naming the path if there is none)."""
    from specray.engine.config import EngineConfig

    model, f = EngineConfig, None
    for part in path:
        assert model is not None and part in model.model_fields, f"EngineConfig has no field {'.'.join(path)}"
        f = model.model_fields[part]
        model = f.default_factory if isinstance(f.default_factory, type) else None
    return f


def test_every_speculator_declared_completely():
    from specray.engine.config import EngineConfig
    from specray.engine.speculators.registry import NEEDS, SPECULATORS, model_speculators
    from specray.native.backends import BACKENDS

    assert {n for n, s in SPECULATORS.items() if s.model} == MODEL_NAMES and set(SPECULATORS) == NAMES | MODEL_NAMES
    assert set(BACKENDS) == MODEL_NAMES, "each model speculator needs one native backend (native/backends.py)"
    for name, spec in SPECULATORS.items():
        assert spec.name == name and issubclass(spec.params, BaseModel), name
        assert spec.params.model_config.get("extra") == "forbid", name
        if not spec.model:
            assert issubclass(spec.speculator, Speculator) and spec.speculator.name == name
            assert not (spec.needs or spec.config_field or spec.missing or spec.cli), name
            continue
        assert "model" in spec.needs and set(spec.needs) <= set(NEEDS), name
        assert callable(BACKENDS[name].open) and callable(BACKENDS[name].taps), name
        _engine_field(spec.config_field)
        assert spec.cli and spec.missing, f"{name}: no command-line option or no 'needs' message"
        assert spec.cli[0].config_path == spec.config_field, f"{name}: its first option sets its config field"
        for option in spec.cli:
            _engine_field(option.config_path)
            assert option.flag.startswith("--") and option.help, option
            assert option.flag in spec.missing and f"engine.{'.'.join(option.config_path)}" in spec.missing
        with pytest.raises(ValueError) as e:
            make_speculator(name)
        assert str(e.value) == f"speculator {name!r} needs {spec.missing}"
        # its config field (and nothing else) enables it; the hidden-row ones turn HiddenStateConfig on
        section, field = spec.config_field
        value = True if isinstance(_engine_field(spec.config_field).default, bool) else "m.gguf"
        cfg = EngineConfig(**{section: {field: value}})
        assert [s.name for s in model_speculators() if s.enabled(cfg)] == [name]
        assert cfg.hidden.enabled == spec.hidden_rows
        assert not spec.enabled(EngineConfig())


def test_model_speculator_options_reach_every_command():
    import argparse

    from specray.cli.main import build_parser
    from specray.cli.serve import _FLAG_FIELDS
    from specray.engine.speculators.registry import cli_options

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "bench", "serve"):
        actions = {a.dest: a for a in sub.choices[command]._actions}
        for option in cli_options():
            a = actions[option.dest]
            assert a.option_strings == [option.flag] and a.help == option.help
            assert a.metavar == option.metavar and a.nargs == (0 if option.switch else None)
            assert a.default == (argparse.SUPPRESS if command == "serve" else option.default), (command, option)
    for option in cli_options():
        assert _FLAG_FIELDS[option.dest] == ("engine", *option.config_path)


#: the files that host, wire or bench model speculators: they look names up in the registry
_LOOKERS = ["deployments/actors/companion.py", "deployments/actors/companion_hidden.py", "native/hidden_heads.py",
            "bench/run.py", "bench/http_compare.py", "cli/main.py", "cli/serve.py"]


@pytest.mark.parametrize("path", _LOOKERS)
def test_model_speculator_names_come_from_the_registry(path):
    """No list of model-speculator names and no hidden-row speculator's name as a literal, except where a class
    declares its own `name` (a speculator or its router-side proxy)."""
    import ast
    import pathlib

    from specray.engine.speculators.registry import model_speculators

    hidden = {s.name for s in model_speculators(hidden_rows=True)}
    tree = ast.parse((pathlib.Path(__file__).resolve().parents[2] / path).read_text())
    own_names = {id(n.value) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body
                 if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["name"]}
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            literal = [e.value for e in elts if isinstance(e, ast.Constant)]
            assert len(MODEL_NAMES.intersection(literal)) < 2, f"{path}:{node.lineno}: a list of speculator names"
        if isinstance(node, ast.Constant) and node.value in hidden:
            assert id(node) in own_names, f"{path}:{node.lineno}: {node.value!r} spelled out; use the registry"
