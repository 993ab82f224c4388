"""The layout rules of docs/architecture.md (import rules), checked on the source (no imports run).

engine imports nothing outside engine; native is the only package that imports
llama_cpp; train is the only one that imports torch; nothing but the CLI (and
tests) imports bench, cli or train; every package
says in its __init__ docstring what lives there; no class grows past ~250
lines (the round loop must stay readable in one short file).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"engine": "specray.engine", "native": "specray.native", "deployments": "specray.deployments",
            "bench": "specray.bench", "cli": "specray.cli", "cluster": "specray.cluster", "train": "specray.train"}
MAX_CLASS_LINES = 260


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


def test_no_class_is_over_max_lines():
    long = []
    for folder in PACKAGES:
        for p in sources(folder):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    long.append(f"{p.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


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
