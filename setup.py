"""The engine's compiled cores: C over Python's own lists and dicts (and numpy's buffers), for loops that run per
token on the round thread (engine/cores.py says which run). Every `_*_core.c` under engine/ is one, built as the
module of its path (engine/speculators/_suffix_core.c: specray.engine.speculators._suffix_core); each has a pure-Python
reference that the tests hold it equal to, and that runs where the core is not built. Everything else about the
package is in pyproject.toml."""

from pathlib import Path

from setuptools import Extension, setup

CORES = sorted(Path("engine").rglob("_*_core.c"))

# optional: where one cannot be built (a Python without its headers), the install goes on with the references.
# -ffp-contract=off: no fused multiply-adds, whatever CFLAGS ask for, so a core's floating-point arithmetic rounds
# as its Python reference's does, operation by operation
setup(ext_modules=[Extension(".".join(["specray", *src.with_suffix("").parts]), [src.as_posix()],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True) for src in CORES])
