"""The `eagle3` speculator's model: an EAGLE-3 draft GGUF (architecture `eagle3`).

Its encoder (llama_process ENCODE: fc over the target's three layer inputs,
concatenated) turns a target row into the decoder's g row; its decoder reads
(token, g) pairs and outputs its own pre-norm row (h_nextn), fed back while
drafting. It must carry its own token embeddings and LM head: a draft that
borrows the target's (llama.cpp's ctx_other) would need the target context
in this process, which the companion actor does not have.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from specray.engine.config import EngineConfig
from specray.engine.hidden_rows import ROW_DTYPE
from specray.engine.speculators.eagle3 import Eagle3Params, Eagle3Speculator
from specray.engine.vocab import VocabMismatchError, vocab_mismatch

from . import ext
from .backends import Backend, head_options, layer_taps
from .context import Context, DecodeError
from .gguf_meta import eagle3_target_layers
from .hidden import PairHead
from .model import Model


class Eagle3Head(PairHead):
    def __init__(self, path: str, target_vocab: Model, *, slots: int, n_ctx: int, n_batch: int = 512,
                 threads: int = 2, calibrate: bool = True) -> None:
        model = Model(path)
        try:
            layers = ext.target_layer_ids(model.ptr)
            if len(layers) != 3:
                raise ValueError(f"{path} is not an EAGLE-3 draft (it names {len(layers)} target layers, not 3)")
            mismatch = vocab_mismatch(target_vocab, model)
            if mismatch is not None:
                raise VocabMismatchError(mismatch, target_vocab.name, path)
            try:
                ctx = Context(model, n_ctx=n_ctx, n_seq_max=slots, n_batch=n_batch, n_threads=threads,
                              kv_unified=True)
            except RuntimeError as e:
                raise RuntimeError(f"{e}: an EAGLE-3 draft without its own token embeddings and LM head is not "
                                   "supported (it would need the target context in the same process)") from None
        except BaseException:
            model.close()
            raise
        super().__init__(model, ctx, int(llama_cpp.llama_model_n_embd(model.ptr)))
        self.taps = tuple(layers)
        self.encodes = 0
        if calibrate:
            self.measure_decode_costs()

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """Target feature rows [n, 3 x n_embd_target] -> decoder rows g [n, n_embd] (the per-token fc fusion)."""
        out = np.empty((len(rows), self.width), dtype=ROW_DTYPE)
        b = self.batch
        n_ubatch = int(llama_cpp.llama_n_ubatch(self.ctx.ptr))
        for i in range(0, len(rows), n_ubatch):
            chunk = rows[i : i + n_ubatch]
            b.clear()
            # the encoder reads no positions and writes no KV; llama.cpp still checks them against seq 0's cells
            b.add_rows(0, chunk, self.ctx.seq_pos_max(0) + 1)
            b.process(encode=True)
            ptr = ext.llama_get_embeddings_nextn(self.ctx.ptr)
            if not ptr:
                raise DecodeError("the EAGLE-3 encoder returned no rows")
            out[i : i + len(chunk)] = np.ctypeslib.as_array(ptr, shape=(len(chunk), self.width))
            self.encodes += 1
        b.clear()
        return out

    def speculator(self, params: Eagle3Params | None = None) -> Eagle3Speculator:
        return Eagle3Speculator(params, self)


config_taps = layer_taps(Eagle3Speculator.name, eagle3_target_layers)


def open_head(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None,
              owned=None) -> Eagle3Head:
    config_taps(cfg)  # a clear error for a missing or non-EAGLE-3 file
    return Eagle3Head(cfg.hidden.eagle3_model, target_vocab, **head_options(cfg, target_n_ctx))


BACKEND = Backend(open_head, config_taps)
