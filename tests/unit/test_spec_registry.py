"""Registry of model-free speculators, and the modules' docstring examples."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
from pydantic import BaseModel

from specray.engine.speculator import DraftRequest, Speculator
from specray.engine.speculators.ngram_simple import NgramSimpleParams, NgramSimpleSpeculator
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


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_taps_of_a_missing_draft_file_name_its_option(name, tmp_path):
    from specray.engine.config import EngineConfig
    from specray.native.backends import BACKENDS

    cfg = EngineConfig(hidden={f"{name}_model": str(tmp_path / "none.gguf")})
    with pytest.raises(FileNotFoundError, match=rf"^--{name}-model \(engine.hidden.{name}_model\): "):
        BACKENDS[name].taps(cfg)


def test_native_backends_docstring_examples():
    from specray.native import backends

    res = doctest.testmod(backends, optionflags=doctest.ELLIPSIS)
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
    from specray.native.backends import BACKENDS, Backend

    assert {n for n, s in SPECULATORS.items() if s.model} == MODEL_NAMES and set(SPECULATORS) == NAMES | MODEL_NAMES
    assert set(BACKENDS) == MODEL_NAMES, "each model speculator needs one native backend (native/NAME_backend.py)"
    for name, spec in SPECULATORS.items():
        assert spec.name == name and issubclass(spec.params, BaseModel), name
        assert spec.params.model_config.get("extra") == "forbid", name
        if not spec.model:
            assert issubclass(spec.speculator, Speculator) and spec.speculator.name == name
            assert not (spec.needs or spec.config_field or spec.missing or spec.cli), name
            continue
        assert "model" in spec.needs and set(spec.needs) <= set(NEEDS), name
        backend = BACKENDS[name]
        assert isinstance(backend, Backend) and callable(backend.open) and callable(backend.taps), name
        assert backend is importlib.import_module(f"specray.native.{name}_backend").BACKEND, name
        # its config field is the one its entry declares (engine/config.py takes it from the registry)
        annotation, declared = spec.config
        f = _engine_field(spec.config_field)
        assert (f.annotation, f.default, f.description) == (annotation, declared.default, declared.description)
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


# ---- a model speculator is three files: its engine module, its native module, its registry entry ---------------

def _fake_spec(**changes):
    """A registry entry for a hidden-row speculator `fake` (parameters borrowed from eagle3), with `changes`."""
    import dataclasses

    from specray.engine.speculators.registry import SPECULATORS

    option = dataclasses.replace(SPECULATORS["eagle3"].cli[0], flag="--fake-model",
                                 config_path=("hidden", "fake_model"))
    parts = dict(name="fake", config_field=("hidden", "fake_model"), cli=(option,),
                 missing="a fake draft: start with --fake-model PATH (engine.hidden.fake_model)")
    return dataclasses.replace(SPECULATORS["eagle3"], **(parts | changes))


#: each part of a model speculator's entry, broken
_BROKEN = {
    "needs": ("hidden_rows", "companion"),  # without "model"
    "config_field": ("draft", "fake_model"),  # it reads hidden rows: its field belongs in `hidden`
    "config": None,  # the field's declaration: engine/config.py would not have it
    "cli": (),
    "missing": "a fake draft",  # names neither its option nor its config path
}


@pytest.mark.parametrize("part", sorted(_BROKEN))
def test_a_model_speculator_entry_lacking_a_part_is_refused_naming_it(part):
    _fake_spec()  # complete
    with pytest.raises(ValueError) as e:
        _fake_spec(**{part: _BROKEN[part]})
    assert str(e.value).startswith(f"model speculator 'fake' lacks {part}"), str(e.value)


def test_a_model_free_entry_with_model_parts_is_refused():
    from specray.engine.speculators.registry import SpeculatorSpec

    with pytest.raises(ValueError, match="model-free speculator 'ngram_simple' has model speculator parts: cli"):
        SpeculatorSpec("ngram_simple", NgramSimpleParams, NgramSimpleSpeculator, cli=_fake_spec().cli)


def test_a_registered_model_speculator_without_its_native_backend_fails_naming_it(monkeypatch):
    import sys
    import types

    from specray.engine.speculators.registry import SPECULATORS
    from specray.native.backends import BACKENDS

    monkeypatch.setitem(SPECULATORS, "fake", _fake_spec())
    assert list(BACKENDS)[-1] == "fake"
    with pytest.raises(LookupError, match=r"'fake' has no native backend: native/fake_backend.py must export "
                                          r"BACKEND = Backend\(open, taps\)"):
        BACKENDS["fake"]  # no such module
    monkeypatch.setitem(sys.modules, "specray.native.fake_backend", types.ModuleType("specray.native.fake_backend"))
    with pytest.raises(LookupError, match="'fake' has no native backend"):
        BACKENDS["fake"]  # a module without BACKEND
    with pytest.raises(KeyError, match="'ngram_mod' is not a model speculator"):
        BACKENDS["ngram_mod"]


def test_a_model_speculator_needs_no_other_file(monkeypatch):
    """Registered (its entry) with a native module exporting BACKEND, a hidden-row speculator is known to the
    native backends, the target's taps and head opening, the command-line options and the config: no other file
    names it (its engine module holds its parameters and speculator, which its backend builds)."""
    import argparse
    import sys
    import types

    from specray.cli.main import build_parser
    from specray.engine.config import EngineConfig
    from specray.engine.speculators.registry import SPECULATORS, cli_options, config_fields, enabled_speculators
    from specray.native.backends import BACKENDS, Backend
    from specray.native.hidden_heads import open_hidden_heads, target_taps

    spec = _fake_spec()
    monkeypatch.setitem(SPECULATORS, "fake", spec)
    fake_module = types.ModuleType("specray.native.fake_backend")
    head = types.SimpleNamespace(speculator=None, info=dict, close=lambda: None)
    fake_module.BACKEND = Backend(open=lambda *a, **k: head, taps=lambda cfg: (7,))
    monkeypatch.setitem(sys.modules, "specray.native.fake_backend", fake_module)

    assert BACKENDS["fake"] is fake_module.BACKEND
    with pytest.raises(ValueError, match=r"needs a fake draft: start with --fake-model"):
        make_speculator("fake")
    assert spec.cli[0] in cli_options(hidden_rows=True)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert ["--fake-model"] in [a.option_strings for a in sub.choices["generate"]._actions]
    # the config section built from the registry now has its field, and it enables the speculator
    hidden = config_fields("hidden")
    assert list(hidden.model_fields) == ["mtp", "eagle3_model", "dflash_model", "fake_model"]
    cfg = EngineConfig.model_construct(hidden=hidden(fake_model="f.gguf"))
    assert enabled_speculators(cfg, hidden_rows=True) == ["fake"] and target_taps(cfg) == (7,)
    assert open_hidden_heads(cfg, None, target_n_ctx=256).named() == {"fake": head}
