"""The layout rules of docs/architecture.md (import rules), checked on the source (no imports run).

engine imports nothing outside engine; native is the only package that imports
llama_cpp; train is the only one that imports torch; nothing but the CLI (and
tests) imports bench, cli or train; every package
says in its __init__ docstring what lives there; no code reaches into another
object's private attributes (a class grows by decomposing it, not by moving its
logic into functions that poke its state).
"""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"engine": "specray.engine", "native": "specray.native", "deployments": "specray.deployments",
            "bench": "specray.bench", "cli": "specray.cli", "cluster": "specray.cluster", "train": "specray.train"}
#: Third-party internals the project must use (no public API gives them), as written in the source, with why.
ALLOWED_PRIVATE = {
    "llama_cpp.llama_cpp._lib": "llama-cpp-python's loaded libllama: native/ext.py binds the symbols it does not",
    "_lib._name": "that ctypes library's file name, for the error naming a symbol it lacks",
    "llama_cpp._logger": "llama-cpp-python's log callback: the only way to quiet or route llama.cpp's logging",
    "ray._private": "Ray's node services (the address of the running local cluster) have no public API",
    "ray.serve._private": "Serve's constants, read once at import as Serve itself does (no public API)",
    "parser._actions": "argparse lists a parser's arguments nowhere else (a config error names the flags)",
    "sp._actions": "the same, for a subcommand's parser",
    "argparse._SubParsersAction": "argparse's subcommand action: the only way to reach the subparsers",
}


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def imported_modules(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(REPO).with_suffix("")
    pkg_parts = ["specray"] + list(rel.parts[:-1])
    pkg_parts[1] = PACKAGES[rel.parts[0]].split(".")[1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module or "")
    return out


def test_imported_modules_resolves_relative_imports():
    mods = imported_modules(REPO / "deployments" / "replica" / "core.py")
    assert "specray.deployments.replica.admission" in mods and "specray.deployments.builder" in mods


@pytest.mark.parametrize("path", sources("engine"), ids=lambda p: str(p.relative_to(REPO)))
def test_engine_imports_nothing_outside_engine(path):
    bad = [m for m in imported_modules(path)
           if m.startswith(("specray.", "llama_cpp", "ray")) and not m.startswith("specray.engine")]
    assert not bad, f"{path.name} imports {bad}"


def test_only_native_imports_llama_cpp():
    offenders = [str(p.relative_to(REPO)) for folder in ("engine", "deployments", "bench", "cli", "cluster", "train")
                 for p in sources(folder) if any(m.split(".")[0] == "llama_cpp" for m in imported_modules(p))]
    assert offenders == []


def test_only_the_cli_imports_bench_cli_and_train():
    offenders = [str(p.relative_to(REPO)) for folder in ("engine", "native", "deployments", "cluster", "train")
                 for p in sources(folder)
                 if any(m.startswith(("specray.bench", "specray.cli")) for m in imported_modules(p))]
    offenders += [str(p.relative_to(REPO)) for folder in ("engine", "native", "deployments", "cluster", "bench")
                  for p in sources(folder) if any(m.startswith("specray.train") for m in imported_modules(p))]
    assert offenders == []


def test_only_train_imports_torch():
    """torch is an optional extra (specray[train]): serving never needs it."""
    offenders = [str(p.relative_to(REPO)) for folder in PACKAGES if folder != "train" for p in sources(folder)
                 if any(m.split(".")[0] == "torch" for m in imported_modules(p))]
    assert offenders == []


@pytest.mark.parametrize("init", sorted(p for f in PACKAGES for p in (REPO / f).rglob("__init__.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_package_says_what_lives_there(init):
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) >= 12, f"{init.relative_to(REPO)} needs a docstring saying what lives there"


def is_private(name: str) -> bool:
    """`_x` (and `__x`, name-mangled), not a dunder."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_own(value: ast.expr) -> bool:
    """self, cls or super(): an object's own attributes."""
    return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")


def private_reaches_in(tree: ast.AST, package: list[str]) -> list[tuple[int, str]]:
    """(line, expression) of each reach into another object's or module's private names in `tree`: `x._name`
    with x not self/cls/super(); getattr/setattr/hasattr/delattr(x, "_name") likewise; `from m import _name`;
    an import of a private module (a `_name` part) from outside the package that holds it. `package`: the
    importing module's package parts, to resolve relative imports.

    >>> reaches = lambda src: sorted(e for _, e in private_reaches_in(ast.parse(src), ["specray", "engine"]))
    >>> reaches("self._a = other._b; super()._c(); x.__len__()")
    ['other._b']
    >>> reaches("getattr(m, '_x', None); from .draft import _Tokens; from ._util import as_tokens")
    ['from specray.engine.draft import _Tokens', "getattr(m, '_x', None)"]
    >>> reaches("from ..native._lib import f; import ray._private")
    ['ray._private', 'specray.native._lib']
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not is_own(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value) and not is_own(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif node.level:
                base = package[: len(package) - node.level + 1]
                modules = [".".join(base + ([node.module] if node.module else []))]
            else:
                modules = [node.module or ""]
            for m in modules:
                parts = m.split(".")
                k = next((i for i, part in enumerate(parts) if is_private(part)), None)
                # a package's private module is its own package's to import
                if k is not None and not (parts[0] == "specray" and package[:k] == parts[:k]):
                    found.append((node.lineno, ".".join(parts[: k + 1])))
            if isinstance(node, ast.ImportFrom):
                found += [(node.lineno, f"from {modules[0]} import {a.name}") for a in node.names if is_private(a.name)]
    return found


def private_reaches(path: Path) -> list[str]:
    """private_reaches_in over a source file and the doctest examples of its docstrings, as 'file:line: expr'."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(REPO)
    package = PACKAGES[rel.parts[0]].split(".") + list(rel.parts[1:-1])
    found = private_reaches_in(tree, package)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            for ex in doctest.DocTestParser().get_examples(doc or ""):
                try:
                    example = ast.parse(ex.source)
                except SyntaxError:
                    continue
                line = getattr(node, "lineno", 1) + ex.lineno
                found += [(line, e) for _, e in private_reaches_in(example, package)]
    return [f"{rel}:{line}: {e}" for line, e in found if e not in ALLOWED_PRIVATE]


def test_private_reaches_finds_each_kind():
    runner = doctest.DocTestRunner()
    for t in doctest.DocTestFinder().find(private_reaches_in, globs=globals()):
        runner.run(t)
    assert runner.summarize(verbose=False) == (0, 4)


def test_no_code_reaches_into_private_attributes():
    """Decompose, don't relocate: a function that needs another object's private state is that object's method,
    or the object gets a public method or property that says what the caller needs. Third-party internals the
    project must use are in ALLOWED_PRIVATE, each with its reason."""
    bad = [hit for folder in PACKAGES for p in sources(folder) for hit in private_reaches(p)]
    assert bad == [], "\n".join(bad)


def test_every_allowed_private_reach_is_still_made():
    """An entry of ALLOWED_PRIVATE nothing uses any more goes."""
    used = set()
    for folder in PACKAGES:
        for p in sources(folder):
            rel = p.relative_to(REPO)
            package = PACKAGES[rel.parts[0]].split(".") + list(rel.parts[1:-1])
            used |= {e for _, e in private_reaches_in(ast.parse(p.read_text()), package)}
    assert sorted(set(ALLOWED_PRIVATE) - used) == []


def constructed(path: Path, names: set[str]) -> set[str]:
    """Which of `names` a file calls (Name(...) or x.Name(...))."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                found.add(name)
    return found


def test_the_builder_is_the_only_place_that_assembles_an_engine():
    """A round scheduler (with its target, chain and calibrated cost model) is put together in
    deployments/builder.py only; every mode and bench goes through build_engine."""
    where = {str(p.relative_to(REPO)): constructed(p, {"Scheduler", "calibrated", "open_target"})
             for folder in ("deployments", "bench", "cli") for p in sources(folder)}
    assemblers = sorted(f for f, names in where.items() if names & {"Scheduler", "calibrated"})
    assert assemblers == ["deployments/builder.py"]
    # the target actor opens its context the builder's way
    assert "open_target" in where["deployments/actors/target.py"]
