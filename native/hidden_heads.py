"""The hidden-state heads of one process (`mtp`, `eagle3`, `dflash`) and the rows the target must output for them.

Co-located, the heads live next to the target (the MTP head shares the
target's loaded weights); distributed, in the companion actor, while the
target actor only needs `target_taps` (read from the config and the EAGLE-3 /
DFlash GGUFs' metadata, without loading any head). A layer both drafts read
is sent once; each speculator picks its columns (HiddenRows.select).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import TAP_NEXTN, Tap

from .gguf_meta import dflash_target_layers, eagle3_target_layers
from .model import Model


def head_n_ctx(cfg: EngineConfig, target_n_ctx: int) -> int:
    """Head context cells: the target's, plus room for each slot's draft pairs."""
    return cfg.hidden.n_ctx or target_n_ctx + 16 * cfg.slots


def target_taps(cfg: EngineConfig) -> tuple[Tap, ...]:
    """The hidden rows the target outputs for the configured heads, in record column order (MTP, then
    EAGLE-3's three layers, then the DFlash draft's layers that EAGLE-3 does not read already)."""
    taps: list[Tap] = []
    if cfg.hidden.mtp:
        taps.append(TAP_NEXTN)
    if cfg.hidden.eagle3_model:
        taps.extend(_eagle3_layers(cfg.hidden.eagle3_model))
    if cfg.hidden.dflash_model:
        taps.extend(t for t in _dflash_layers(cfg.hidden.dflash_model) if t not in taps)
    return merge_taps(taps)


def merge_taps(taps) -> tuple[Tap, ...]:
    """Each tap once, first come first placed: two drafts reading one layer get one copy of its rows.

    >>> merge_taps(["nextn", 2, 15, 27, 1, 15, 27])
    ('nextn', 2, 15, 27, 1)
    """
    return tuple(dict.fromkeys(taps))


def _eagle3_layers(path: str) -> tuple[int, ...]:
    try:
        return eagle3_target_layers(path)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--eagle3-model (engine.hidden.eagle3_model): {e}") from None


def _dflash_layers(path: str) -> tuple[int, ...]:
    try:
        return dflash_target_layers(path)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--dflash-model (engine.hidden.dflash_model): {e}") from None


@dataclass
class HiddenHeads:
    mtp: object | None = None  # native.mtp_backend.MtpHead
    eagle3: object | None = None  # native.eagle3_backend.Eagle3Head
    dflash: object | None = None  # native.dflash_backend.DFlashHead
    own_mtp_model: Model | None = None  # loaded for the MTP head alone (not shared with a target context)

    def named(self) -> dict[str, object]:
        """The heads that are open, by speculator name."""
        return {n: h for n, h in (("mtp", self.mtp), ("eagle3", self.eagle3), ("dflash", self.dflash))
                if h is not None}

    @property
    def taps(self) -> tuple[Tap, ...]:
        return merge_taps(t for head in self.named().values() for t in head.taps)

    def builders(self) -> dict[str, Callable]:
        """Speculator builders for registry.speculator_factory: name -> (params -> speculator)."""
        return {name: head.speculator for name, head in self.named().items()}

    def info(self) -> dict:
        return {name: head.info() for name, head in self.named().items()}

    def close(self) -> None:
        for head in self.named().values():
            head.close()
        if self.own_mtp_model is not None:
            self.own_mtp_model.close()


def open_hidden_heads(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int,
                      target_model: Model | None = None) -> HiddenHeads | None:
    """The configured heads (None if there are none). `target_model`: the target's loaded weights, shared by
    the MTP head if they were loaded with their NextN blocks (co-located); else the head loads its own copy."""
    h = cfg.hidden
    if not h.enabled:
        return None
    from .eagle3_backend import Eagle3Head
    from .mtp_backend import MtpHead

    heads = HiddenHeads()
    common = dict(slots=cfg.slots, n_ctx=head_n_ctx(cfg, target_n_ctx), n_batch=cfg.n_batch,
                  threads=h.threads or cfg.threads, calibrate=cfg.calibrate)
    try:
        if h.mtp:
            model = target_model if target_model is not None and target_model.load_mtp else None
            if model is None:
                model = heads.own_mtp_model = Model(cfg.model, load_mtp=True, chat_template=cfg.chat_template)
            try:
                heads.mtp = MtpHead(model, **common)
            except ValueError as e:
                raise ValueError(f"--mtp (engine.hidden.mtp): {e}") from None
        if h.eagle3_model:
            _eagle3_layers(h.eagle3_model)  # a clear error for a missing or non-EAGLE-3 file
            heads.eagle3 = Eagle3Head(h.eagle3_model, target_vocab, **common)
        if h.dflash_model:
            from .dflash_backend import DFlashHead

            _dflash_layers(h.dflash_model)  # a clear error for a missing or non-DFlash file
            heads.dflash = DFlashHead(h.dflash_model, target_vocab, **common)
    except BaseException:
        heads.close()
        raise
    return heads
