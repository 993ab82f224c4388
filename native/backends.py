"""The native half of each model speculator, one `Backend` per registry name (engine/speculators/registry.py).

The registry says what a model speculator is (parameters, needs, config field,
options); this table says how its model is opened here, in the one package that
touches llama.cpp. Whoever hosts the models (the co-located engine, the
companion actor) opens the configured ones through it and passes each one's
`speculator` method to registry.speculator_factory; the target reads `taps`
to know which hidden rows to output.

>>> sorted(BACKENDS)
['dflash', 'draft', 'eagle3', 'mtp']
>>> BACKENDS["draft"].taps(None)
()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import TAP_NEXTN, Tap
from specray.engine.speculators.registry import SPECULATORS

from .gguf_meta import dflash_target_layers, eagle3_target_layers
from .model import Model


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


def head_n_ctx(cfg: EngineConfig, target_n_ctx: int) -> int:
    """Head context cells: the target's, plus room for each slot's draft pairs."""
    return cfg.hidden.n_ctx or target_n_ctx + 16 * cfg.slots


def _head_options(cfg: EngineConfig, target_n_ctx: int) -> dict:
    return dict(slots=cfg.slots, n_ctx=head_n_ctx(cfg, target_n_ctx), n_batch=cfg.n_batch,
                threads=cfg.hidden.threads or cfg.threads, calibrate=cfg.calibrate)


def option_error(name: str, e: Exception) -> Exception:
    """`e` prefixed with the option and config field that configured speculator `name`, same type.

    >>> option_error("eagle3", ValueError("not an EAGLE-3 GGUF"))
    ValueError('--eagle3-model (engine.hidden.eagle3_model): not an EAGLE-3 GGUF')
    """
    option = SPECULATORS[name].cli[0]
    return type(e)(f"{option.flag} (engine.{'.'.join(option.config_path)}): {e}")


def _layers(name: str, read: Callable[[str], tuple[int, ...]]) -> Callable[[EngineConfig], tuple[Tap, ...]]:
    def taps(cfg: EngineConfig) -> tuple[Tap, ...]:
        try:
            section, field = SPECULATORS[name].config_field
            return read(getattr(getattr(cfg, section), field))
        except (FileNotFoundError, ValueError) as e:
            raise option_error(name, e) from None

    return taps


def _open_draft(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None, owned=None):
    from .draft_backend import DraftModel

    return DraftModel(cfg.draft, target_vocab, slots=cfg.slots, target_n_ctx=target_n_ctx,
                      settings=cfg.draft_settings(), calibrate=cfg.calibrate)


def _open_mtp(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model: Model | None = None,
              owned: list):
    """The MTP head shares the target's loaded weights if they were loaded with their NextN blocks
    (co-located); else it loads its own copy."""
    from .mtp_backend import MtpHead

    model = target_model if target_model is not None and target_model.load_mtp else None
    if model is None:
        model = Model(cfg.model, load_mtp=True, chat_template=cfg.chat_template)
        owned.append(model)
    try:
        return MtpHead(model, **_head_options(cfg, target_n_ctx))
    except ValueError as e:
        raise option_error("mtp", e) from None


def _open_eagle3(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None, owned=None):
    from .eagle3_backend import Eagle3Head

    BACKENDS["eagle3"].taps(cfg)  # a clear error for a missing or non-EAGLE-3 file
    return Eagle3Head(cfg.hidden.eagle3_model, target_vocab, **_head_options(cfg, target_n_ctx))


def _open_dflash(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None, owned=None):
    from .dflash_backend import DFlashHead

    BACKENDS["dflash"].taps(cfg)  # a clear error for a missing or non-DFlash file
    return DFlashHead(cfg.hidden.dflash_model, target_vocab, **_head_options(cfg, target_n_ctx))


#: model speculator name (registry.SPECULATORS) -> its native backend
BACKENDS: dict[str, Backend] = {
    "draft": Backend(_open_draft),
    "mtp": Backend(_open_mtp, lambda cfg: (TAP_NEXTN,)),
    "eagle3": Backend(_open_eagle3, _layers("eagle3", eagle3_target_layers)),
    "dflash": Backend(_open_dflash, _layers("dflash", dflash_target_layers)),
}
