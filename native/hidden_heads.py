"""The hidden-state heads of one process (`mtp`, `eagle3`, `dflash`) and the rows the target must output for them.

Co-located, the heads live next to the target (the MTP head shares the
target's loaded weights); distributed, in the companion actor, while the
target actor only needs `target_taps` (read from the config and the EAGLE-3 /
DFlash GGUFs' metadata, without loading any head). A layer both drafts read
is sent once; each speculator picks its columns (HiddenRows.select).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import Tap
from specray.engine.speculators.registry import enabled_speculators

from .backends import BACKENDS
from .model import Model


def target_taps(cfg: EngineConfig) -> tuple[Tap, ...]:
    """The hidden rows the target outputs for the configured heads, in record column order (the heads in
    registry order: MTP, then EAGLE-3's three layers, then the DFlash draft's layers that EAGLE-3 does not read
    already)."""
    return merge_taps(t for name in enabled_speculators(cfg, hidden_rows=True) for t in BACKENDS[name].taps(cfg))


def merge_taps(taps) -> tuple[Tap, ...]:
    """Each tap once, first come first placed: two drafts reading one layer get one copy of its rows.

    >>> merge_taps(["nextn", 2, 15, 27, 1, 15, 27])
    ('nextn', 2, 15, 27, 1)
    """
    return tuple(dict.fromkeys(taps))


@dataclass
class HiddenHeads:
    """The open heads by speculator name (registry order), and the models loaded for a head alone (the MTP
    head's own copy of the target when it cannot share the target's weights)."""

    heads: dict[str, object] = field(default_factory=dict)
    owned: list[Model] = field(default_factory=list)

    def named(self) -> dict[str, object]:
        """The heads that are open, by speculator name."""
        return dict(self.heads)

    @property
    def taps(self) -> tuple[Tap, ...]:
        return merge_taps(t for head in self.heads.values() for t in head.taps)

    def builders(self) -> dict[str, Callable]:
        """Speculator builders for registry.speculator_factory: name -> (params -> speculator)."""
        return {name: head.speculator for name, head in self.heads.items()}

    def info(self) -> dict:
        return {name: head.info() for name, head in self.heads.items()}

    def close(self) -> None:
        for head in self.heads.values():
            head.close()
        for model in self.owned:
            model.close()


def open_hidden_heads(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int,
                      target_model: Model | None = None) -> HiddenHeads | None:
    """The configured heads (None if there are none), each opened by its native backend (`BACKEND` in
    native/NAME_backend.py, native/backends.BACKENDS).
    `target_model`: the target's loaded weights, shared by the MTP head if they were loaded with their NextN
    blocks (co-located); else the head loads its own copy."""
    names = enabled_speculators(cfg, hidden_rows=True)
    if not names:
        return None
    heads = HiddenHeads()
    try:
        for name in names:
            heads.heads[name] = BACKENDS[name].open(cfg, target_vocab, target_n_ctx=target_n_ctx,
                                                    target_model=target_model, owned=heads.owned)
    except BaseException:
        heads.close()
        raise
    return heads
