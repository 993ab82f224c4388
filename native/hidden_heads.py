"""The hidden-state heads of one process (`mtp`, `eagle3`) and the rows the target must output for them.

Co-located, the heads live next to the target (the MTP head shares the
target's loaded weights); distributed, in the companion actor, while the
target actor only needs `target_taps` (read from the config and the EAGLE-3
GGUF's metadata, without loading any head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import TAP_NEXTN, Tap

from .gguf_meta import eagle3_target_layers
from .model import Model


def head_n_ctx(cfg: EngineConfig, target_n_ctx: int) -> int:
    """Head context cells: the target's, plus room for each slot's draft pairs."""
    return cfg.hidden.n_ctx or target_n_ctx + 16 * cfg.slots


def target_taps(cfg: EngineConfig) -> tuple[Tap, ...]:
    """The hidden rows the target outputs for the configured heads, in record column order (MTP, then
    EAGLE-3's three layers)."""
    taps: list[Tap] = []
    if cfg.hidden.mtp:
        taps.append(TAP_NEXTN)
    if cfg.hidden.eagle3_model:
        taps.extend(_eagle3_layers(cfg.hidden.eagle3_model))
    if len(set(taps)) != len(taps):
        raise ValueError(f"hidden taps {taps} repeat a row")
    return tuple(taps)


def _eagle3_layers(path: str) -> tuple[int, ...]:
    try:
        return eagle3_target_layers(path)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--eagle3-model (engine.hidden.eagle3_model): {e}") from None


@dataclass
class HiddenHeads:
    mtp: object | None = None  # native.mtp_backend.MtpHead
    eagle3: object | None = None  # native.eagle3_backend.Eagle3Head
    own_mtp_model: Model | None = None  # loaded for the MTP head alone (not shared with a target context)

    @property
    def taps(self) -> tuple[Tap, ...]:
        return tuple(t for head in (self.mtp, self.eagle3) if head is not None for t in head.taps)

    def builders(self) -> dict[str, Callable]:
        """Speculator builders for registry.speculator_factory: name -> (params -> speculator)."""
        out: dict[str, Callable] = {}
        if self.mtp is not None:
            out["mtp"] = self.mtp.speculator
        if self.eagle3 is not None:
            out["eagle3"] = self.eagle3.speculator
        return out

    def info(self) -> dict:
        return {name: head.info() for name, head in (("mtp", self.mtp), ("eagle3", self.eagle3)) if head is not None}

    def close(self) -> None:
        for head in (self.mtp, self.eagle3):
            if head is not None:
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
    except BaseException:
        heads.close()
        raise
    return heads
