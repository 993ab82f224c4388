"""The native half of each model speculator: `BACKENDS[name]`, the `BACKEND` its own module exports.

The registry (engine/speculators/registry.py) says what a model speculator is
(parameters, needs, config field, options); its backend says how its model is
opened here, in the one package that touches llama.cpp. The backend of
speculator NAME is `BACKEND = Backend(...)` in `native/NAME_backend.py`, found
by that name: adding a speculator edits no table here. Whoever hosts the models
(the co-located engine, the companion actor) opens the configured ones through
it and passes each one's `speculator` method to registry.speculator_factory;
the target reads `taps` to know which hidden rows to output.

>>> sorted(BACKENDS)
['dflash', 'draft', 'eagle3', 'mtp']
>>> BACKENDS["draft"].taps(None)
()
>>> BACKENDS["ngram_mod"]
Traceback (most recent call last):
...
KeyError: "'ngram_mod' is not a model speculator (engine/speculators/registry.py); model speculators: draft, mtp, eagle3, dflash"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import Tap
from specray.engine.speculators.registry import SPECULATORS, model_speculators


def _no_taps(cfg: EngineConfig | None) -> tuple[Tap, ...]:
    return ()


@dataclass(frozen=True)
class Backend:
    """How one model speculator's model is opened.

    `open(cfg, target_vocab, *, target_n_ctx, target_model, owned)` returns an object with
    `speculator(params)`, `info()` and `close()` (a DraftModel, a hidden head); a model it loads for itself
    alone goes into the list `owned` (closed after it). `taps(cfg)`: the target's hidden rows it reads, in
    record column order (none for a speculator that reads no rows); it fails, naming the option, on a
    file that cannot be this speculator's model.
    """

    open: Callable[..., object]
    taps: Callable[[EngineConfig], tuple[Tap, ...]] = _no_taps


class _Backends(Mapping[str, Backend]):
    """Model speculator name (registry order) -> its Backend. Each module is imported at its first look-up,
    not here: the backend modules import this one (for `Backend` and the helpers below)."""

    def __getitem__(self, name: str) -> Backend:
        spec = SPECULATORS.get(name)
        if spec is None or not spec.model:
            known = ", ".join(s.name for s in model_speculators())
            raise KeyError(f"{name!r} is not a model speculator (engine/speculators/registry.py); model "
                           f"speculators: {known}")
        try:
            module = importlib.import_module(f"{__package__}.{name}_backend")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}_backend":
                raise  # the module is there; something it imports is not
            module = None
        found = getattr(module, "BACKEND", None)
        if not isinstance(found, Backend):
            raise LookupError(f"model speculator {name!r} has no native backend: native/{name}_backend.py must "
                              f"export BACKEND = Backend(open, taps)")
        return found

    def __iter__(self) -> Iterator[str]:
        return (s.name for s in model_speculators())

    def __len__(self) -> int:
        return len(model_speculators())


#: model speculator name (registry.SPECULATORS) -> its native backend (`BACKEND` in native/<name>_backend.py)
BACKENDS: Mapping[str, Backend] = _Backends()


def head_n_ctx(cfg: EngineConfig, target_n_ctx: int) -> int:
    """Head context cells: the target's, plus room for each slot's draft pairs."""
    return cfg.hidden.n_ctx or target_n_ctx + 16 * cfg.slots


def head_options(cfg: EngineConfig, target_n_ctx: int) -> dict:
    """The keyword options every hidden-row head's context takes from the engine's config."""
    return dict(slots=cfg.slots, n_ctx=head_n_ctx(cfg, target_n_ctx), n_batch=cfg.n_batch,
                threads=cfg.hidden.threads or cfg.threads, calibrate=cfg.calibrate)


def option_error(name: str, e: Exception) -> Exception:
    """`e` prefixed with the option and config field that configured speculator `name`, same type.

    >>> option_error("eagle3", ValueError("not an EAGLE-3 GGUF"))
    ValueError('--eagle3-model (engine.hidden.eagle3_model): not an EAGLE-3 GGUF')
    """
    option = SPECULATORS[name].cli[0]
    return type(e)(f"{option.flag} (engine.{'.'.join(option.config_path)}): {e}")


def layer_taps(name: str, read: Callable[[str], tuple[int, ...]]) -> Callable[[EngineConfig], tuple[Tap, ...]]:
    """A `taps` for speculator `name` whose draft GGUF (the path in its config field) names the target layers
    it reads: `read(path)`, errors prefixed as option_error."""

    def taps(cfg: EngineConfig) -> tuple[Tap, ...]:
        try:
            return read(SPECULATORS[name].config_value(cfg))
        except (FileNotFoundError, ValueError) as e:
            raise option_error(name, e) from None

    return taps
