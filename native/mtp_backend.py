"""The `mtp` speculator's head: an MTP context (LLAMA_CONTEXT_TYPE_MTP) on the target's own weights.

The model must be loaded with `load_mtp=True` (its NextN blocks; llama.cpp
skips them otherwise) and carry NextN layers (`<arch>.nextn_predict_layers`).
Co-located, the head shares the target's loaded model; in the companion actor
it loads the same GGUF. Its KV cache holds only the NextN layer, one sequence
per slot; its input rows are the target's h_nextn rows (n_embd_out wide).
"""

from __future__ import annotations

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import TAP_NEXTN
from specray.engine.speculators.mtp import MtpParams, MtpSpeculator

from . import ext
from .backends import Backend, head_options, option_error
from .context import Context
from .hidden import PairHead
from .model import Model


class MtpHead(PairHead):
    taps = (TAP_NEXTN,)

    def __init__(self, model: Model, *, slots: int, n_ctx: int, n_batch: int = 512, threads: int = 2,
                 calibrate: bool = True) -> None:
        if not model.load_mtp:
            raise ValueError(f"model {model.name} was loaded without its NextN (MTP) blocks (load_mtp=False)")
        if ext.n_layer_nextn(model.ptr) == 0:
            raise ValueError(f"model {model.name} has no NextN (MTP) layers (nextn_predict_layers = 0)")
        ctx = Context(model, n_ctx=n_ctx, n_seq_max=slots, n_batch=n_batch, n_threads=threads, kv_unified=True,
                      ctx_type=ext.LLAMA_CONTEXT_TYPE_MTP)
        super().__init__(model, ctx, int(ext.llama_model_n_embd_out(model.ptr)))
        self.n_layer_nextn = ext.n_layer_nextn(model.ptr)
        if calibrate:
            self.measure_decode_costs()

    def speculator(self, params: MtpParams | None = None) -> MtpSpeculator:
        return MtpSpeculator(params, self)


def open_head(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model: Model | None = None,
              owned: list) -> MtpHead:
    """The MTP head shares the target's loaded weights if they were loaded with their NextN blocks
    (co-located); else it loads its own copy."""
    model = target_model if target_model is not None and target_model.load_mtp else None
    if model is None:
        model = Model(cfg.model, load_mtp=True, chat_template=cfg.chat_template)
        owned.append(model)
    try:
        return MtpHead(model, **head_options(cfg, target_n_ctx))
    except ValueError as e:
        raise option_error(MtpSpeculator.name, e) from None


BACKEND = Backend(open_head, lambda cfg: MtpHead.taps)
