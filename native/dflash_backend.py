"""The `dflash` speculator's model: a DFlash block-diffusion draft GGUF (architecture `dflash`).

As llama.cpp's common_speculative_impl_draft_dflash drives it: a batch of
feature rows (the target layers' inputs, concatenated; llama.cpp's "embd"
batch) goes through the draft's fc fusion and is written into its KV cache at
the rows' positions; a batch of tokens, the block [anchor, <mask> x n] of each
sequence, is decoded with non-causal attention (unless the GGUF says
`dflash.attention.causal`), and the block positions 1..n give the draft. A
non-causal decode must fit one ubatch (llama.cpp asserts it), so the context's
ubatch is its batch, and decodes are cut to whole blocks that fit.

DFlash2 (`dflash.selector_top_k` > 0) returns no usable logits: its graph packs,
per block position, the top-k candidates and the pairwise transition scores
into the h_nextn rows; the draft is the greedy walk through that lattice (as
llama.cpp), and every block of one decode must have the same length.

The draft must carry its own token embeddings and LM head (a draft sharing the
target's through llama.cpp's ctx_other needs the target context in this
process). DSpark drafts (a Markov head, anchor-first blocks) are not supported.
"""

from __future__ import annotations

import ctypes
import time

import llama_cpp
import numpy as np

from specray.engine.config import EngineConfig
from specray.engine.cost import paired_decode_costs
from specray.engine.hidden_rows import ROW_DTYPE
from specray.engine.speculators.dflash import DFlashParams, DFlashSpeculator
from specray.engine.vocab import VocabMismatchError, vocab_mismatch

from . import ext
from .backends import Backend, head_options, layer_taps
from .context import Context, DecodeError
from .gguf_meta import dflash_target_layers
from .hidden import PairBatch, model_arch
from .model import Model
from .slot_backend import SlotBackend, top_token_probs


def _meta_str(model: Model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model.ptr, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def lattice_walk(rows: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """DFlash2's greedy walk: rows[i] (block position i >= 1) holds the top-k candidate ids, then k x k scores
    [predecessor][candidate]; position 1's predecessor is the anchor (every row of its scores is the same).
    Returns the tokens and, per token, the softmax of its score among the k (what p_min reads).

    >>> r = np.zeros((3, 2 + 4), np.float32)
    >>> r[1, :2], r[1, 2:] = [7, 9], [0.0, 1.0, 0.0, 1.0]       # 9 wins after the anchor
    >>> r[2, :2], r[2, 2:] = [4, 5], [3.0, 0.0, 0.0, 2.0]       # after candidate 1 (9): 5 wins
    >>> toks, p = lattice_walk(r, 2); toks.tolist(), p.round(2).tolist()
    ([9, 5], [0.73, 0.88])
    """
    toks, probs = [], []
    pred = 0
    for i in range(1, len(rows)):
        scores = rows[i, top_k + pred * top_k : top_k + (pred + 1) * top_k].astype(np.float64)
        pred = int(scores.argmax())
        probs.append(1.0 / np.exp(scores - scores[pred]).sum())
        toks.append(int(rows[i, pred]))
    return np.array(toks, dtype=np.int32), np.array(probs, dtype=np.float64)


class DFlashHead(SlotBackend):
    def __init__(self, path: str, target_vocab: Model, *, slots: int, n_ctx: int, n_batch: int = 512,
                 threads: int = 2, calibrate: bool = True) -> None:
        model = Model(path)
        try:
            layers = ext.target_layer_ids(model.ptr)
            if model_arch(model) != "dflash" or not layers:
                raise ValueError(f"{path} is not a DFlash draft (architecture {model_arch(model)!r})")
            mismatch = vocab_mismatch(target_vocab, model)
            if mismatch is not None:
                raise VocabMismatchError(mismatch, target_vocab.name, path)
            self.mask = int(llama_cpp.llama_vocab_mask(model.vocab))
            if self.mask < 0:
                raise ValueError(f"{path} has no mask token (tokenizer.ggml.mask_token_id)")
            self.block_size = int(_meta_str(model, "dflash.block_size") or 16)  # llama.cpp's default
            self.top_k = max(0, int(ext.llama_model_dflash_selector_top_k(model.ptr)))
            # every slot's block in one decode, and a non-causal decode is one ubatch
            n_batch = max(n_batch, slots * self.block_size)
            try:
                ctx = Context(model, n_ctx=n_ctx, n_seq_max=slots, n_batch=n_batch, n_ubatch=n_batch,
                              n_threads=threads, kv_unified=True)
            except RuntimeError as e:
                raise RuntimeError(f"{e}: a DFlash draft without its own token embeddings and LM head is not "
                                   "supported (it would need the target context in the same process)") from None
        except BaseException:
            model.close()
            raise
        super().__init__(model, ctx)
        self.taps = tuple(layers)
        self.width = len(layers) * model.n_embd  # the draft's width is the target's (its fc input)
        llama_cpp.llama_set_causal_attn(ctx.ptr, _meta_str(model, "dflash.attention.causal") == "true")
        if self.top_k:
            ext.llama_set_embeddings_nextn(ctx.ptr, True, False)  # the lattice: a row for every block token
        self.batch = PairBatch(ctx)
        self._inject_costs: dict[int, float] = {}
        self.injected_rows = 0
        if calibrate:
            self.measure_decode_costs()

    # ---- KV ------------------------------------------------------------------------------------------
    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        if not self.ctx.seq_rm(seq_id, p0, p1):
            raise DecodeError(f"could not remove positions [{p0}, {p1}) of draft sequence {seq_id}")

    def kv_shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self.ctx.mem, seq_id, p0, p1, delta)

    # ---- decodes -------------------------------------------------------------------------------------
    def inject(self, runs: list[tuple[int, int, np.ndarray]]) -> None:
        b = self.batch
        b.clear()
        for seq_id, pos0, rows in runs:
            rows = np.ascontiguousarray(rows, dtype=ROW_DTYPE)
            for off in range(0, len(rows), self.n_batch):
                chunk = rows[off : off + self.n_batch]
                if b.n_tokens + len(chunk) > self.n_batch:
                    self._process()
                b.add_rows(seq_id, chunk, pos0 + off, output=False)
        self._process()
        self.injected_rows += sum(len(r[2]) for r in runs)

    def _process(self) -> None:
        if self.batch.n_tokens:
            self.batch.process()
            self.n_decodes += 1
        self.batch.clear()

    def draft_blocks(self, blocks: list[tuple[int, int, int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        out: list = [None] * len(blocks)
        n_common = max(n for *_, n in blocks)  # DFlash2: the blocks of one decode have one length
        group: list[int] = []
        size = 0
        for i, (_, _, _, n) in enumerate(blocks):
            tokens = (n_common if self.top_k else n) + 1
            if size + tokens > self.n_batch:
                self._decode_blocks(blocks, group, out, n_common)
                group, size = [], 0
            group.append(i)
            size += tokens
        self._decode_blocks(blocks, group, out, n_common)
        return out

    def _decode_blocks(self, blocks, group: list[int], out: list, n_common: int) -> None:
        if not group:
            return
        b = self.batch
        b.clear()
        lens = []
        for i in group:
            seq_id, pos, anchor, n = blocks[i]
            n = n_common if self.top_k else n
            toks = np.full(n + 1, self.mask, dtype=np.int32)
            toks[0] = anchor
            # every token outputs (the anchor's row is dropped below), or none (the lattice): with a subset,
            # llama.cpp returned the block's first n rows in place of rows 1..n, each draft a position early
            # (measured on the synthetic draft: the subset's top tokens were the full block's shifted by one)
            b.add_tokens(seq_id, toks, pos, first_output=0 if not self.top_k else n + 1)
            lens.append(n + 1)
        self._process()
        if self.top_k:
            lattice = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(self.ctx.ptr),
                                            shape=(sum(lens), self.model.n_embd))
            o = 0
            for i, n in zip(group, lens):
                toks, probs = lattice_walk(lattice[o : o + n], self.top_k)
                out[i] = (toks[: blocks[i][3]], probs[: blocks[i][3]])
                o += n
            return
        logits = self.ctx.logits(sum(lens))
        top, prob = top_token_probs(logits)
        o = 0
        for i, n in zip(group, lens):
            out[i] = (top[o + 1 : o + n].copy(), prob[o + 1 : o + n].copy())
            o += n

    # ---- costs ---------------------------------------------------------------------------------------
    def inject_costs(self) -> dict[int, float]:
        return dict(self._inject_costs)

    def measure_decode_costs(self, reps: int = 3, prefix: int = 32) -> dict[int, float]:
        """Seconds per block decode by its tokens (k sequences x a block, after a `prefix`-row window each) and
        per injection decode by its rows."""
        slots, bs = self.ctx.n_seq_max, self.block_size
        rows = np.zeros((prefix, self.width), dtype=ROW_DTYPE)
        seqs = list(range(slots))
        for s in seqs:
            self.ctx.clear_seq(s)
        self.inject([(s, 0, rows) for s in seqs])
        shapes = {2: (1, 2), bs: (1, bs)} | {k * bs: (k, bs) for k in (2, 4, 8, 16) if k <= slots}
        shapes = {n: kl for n, kl in shapes.items() if n <= self.n_batch}

        def timed_block(n: int) -> float:
            k, length = shapes.get(n, (1, n))
            t0 = time.perf_counter()
            self.draft_blocks([(s, prefix, 100, length - 1) for s in seqs[:k]])
            dt = time.perf_counter() - t0
            for s in seqs[:k]:
                self.ctx.seq_rm(s, prefix, -1)
            return dt

        def timed_inject(n: int) -> float:
            t0 = time.perf_counter()
            self.inject([(0, prefix, np.zeros((n, self.width), dtype=ROW_DTYPE))])
            dt = time.perf_counter() - t0
            self.ctx.seq_rm(0, prefix, -1)
            return dt

        for n in (1, *shapes):
            timed_block(n)
        self._costs = paired_decode_costs(tuple(sorted({1, *shapes})), reps, timed_block)
        sizes = tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n <= self.n_batch)
        self._inject_costs = paired_decode_costs(sizes, reps, timed_inject)
        for s in seqs:
            self.ctx.clear_seq(s)
        return self._costs

    def info(self) -> dict:
        return {"model": self.model.name, "description": self.model.description, "taps": list(self.taps),
                "width": self.width, "n_ctx": self.ctx.n_ctx, "block_size": self.block_size,
                "mask_token": self.mask, "selector_top_k": self.top_k,
                "decode_cost_ms": {k: v * 1000 for k, v in self._costs.items()},
                "inject_cost_ms": {k: v * 1000 for k, v in self._inject_costs.items()}}

    def speculator(self, params: DFlashParams | None = None) -> DFlashSpeculator:
        return DFlashSpeculator(params, self)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


config_taps = layer_taps(DFlashSpeculator.name, dflash_target_layers)


def open_head(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None,
              owned=None) -> DFlashHead:
    config_taps(cfg)  # a clear error for a missing or non-DFlash file
    return DFlashHead(cfg.hidden.dflash_model, target_vocab, **head_options(cfg, target_n_ctx))


BACKEND = Backend(open_head, config_taps)
