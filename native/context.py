"""A llama_context with n_seq_max sequence slots: decode, logits views, KV ops, state."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import llama_cpp
import numpy as np

from . import decode_threads, lib
from .batch import Batch
from .host_memory import HostBufferPool, SavedCells, host_buffer
from .model import Model


#: GGML_TYPE_BF16 of ggml.h: llama-cpp-python's bindings lack the constant
GGML_TYPE_BF16 = 30
#: KV cache data types by llama.cpp's names (-ctk / -ctv), as ggml_type values for llama_context_params
CACHE_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "bf16": GGML_TYPE_BF16,
               "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0, "q4_1": llama_cpp.GGML_TYPE_Q4_1,
               "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL, "q5_0": llama_cpp.GGML_TYPE_Q5_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1}


def cache_type(name: str) -> int:
    """The ggml_type of a KV cache type name ('q8_0' -> GGML_TYPE_Q8_0); ValueError naming the choices."""
    if name not in CACHE_TYPES:
        raise ValueError(f"KV cache type must be one of {', '.join(CACHE_TYPES)}, got {name!r}")
    return CACHE_TYPES[name]


#: llama.cpp rounds a context, and each KV stream's share of it, up to a multiple of this (llama-context.cpp)
CTX_PAD = 256

#: query rows of the CPU flash-attention kernel's tile (GGML_FA_TILE_Q, ggml-cpu/common.h). A ubatch of at least
#: this many rows runs the tiled kernel, a GEMM per tile of query rows x KV cells; a smaller one takes each row
#: alone over every cell, several times slower per row and cell once the context is long (ops.cpp
#: ggml_compute_forward_flash_attn_ext_f16)
CPU_FA_TILE_ROWS = 64

#: llama_get_logits, returning the output buffer's address as an int. The binding's own returns a new ctypes pointer
#: object, which then takes a cast to compare: on the round thread, right after a decode, that machinery is out of
#: the CPU's caches and cost several times this call
_logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value)


def n_ctx_for_seq(cells: int, slots: int, kv_unified: bool) -> int:
    """The smallest n_ctx, as llama.cpp sizes a context, that gives one sequence `cells` KV cells: unified,
    every sequence may use the whole (padded) context; otherwise (exact mode) each of the `slots` streams
    gets n_ctx / slots, padded.

    >>> n_ctx_for_seq(926 + 128 + 1, 4, kv_unified=False)  # 4 streams of 1280 cells
    5120
    >>> n_ctx_for_seq(1055, 4, kv_unified=True)
    1280
    >>> n_ctx_for_seq(300, 1, kv_unified=False)
    512
    """
    per_seq = -(-cells // CTX_PAD) * CTX_PAD
    return per_seq if kv_unified else per_seq * slots


class DecodeError(RuntimeError):
    pass


class Context:
    """One llama_context. Not thread-safe: callers hold `self.lock` around use.

    kv_unified=True: all slots share the n_ctx cells (a slot can use the whole
    context; llama-server does the same for parallel slots).
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_seq_max: int = 4,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int = 2,
        n_threads_batch: int | None = None,
        flash_attn: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
        kv_unified: bool | None = None,
        swa_full: bool = True,
        exact: bool = False,
        ctx_type: int = 0,
        n_rs_seq: int = 0,
        outputs_per_seq: int | None = None,
    ) -> None:
        lib.ensure_backend()
        self.model = model
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch or n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch or n_threads
        params.type_k, params.type_v = cache_type(type_k), cache_type(type_v)
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        # Exact mode needs each sequence's KV cells at the same indices as in a
        # solo run (attention sums over cells in index order): one KV stream per
        # slot. The fast mode shares one stream (fewer ubatch splits).
        if kv_unified is None:
            kv_unified = not exact
        params.kv_unified = kv_unified
        params.no_perf = True
        params.swa_full = swa_full
        # recurrent-state snapshots per sequence (llama.cpp's partial rollback of the last n_rs_seq tokens); only
        # some architectures have it: llama.cpp clamps the request to 0 for the others (read back below)
        params.n_rs_seq = n_rs_seq
        params.ctx_type = ctx_type  # 1 = LLAMA_CONTEXT_TYPE_MTP: runs the model's NextN head (native/mtp_backend.py)
        if outputs_per_seq is not None:  # outputs one sequence may have in a batch under backend sampling (1 else)
            params.n_outputs_max_per_seq = outputs_per_seq
        self._samplers: dict[int, object] = {}  # seq_id -> its backend sampler chain (set_greedy_backend)
        self.saved_buffers = HostBufferPool()  # dropped host-tier saves' buffers, for the next saves (save_seq)
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max}, cache "
                               f"types K {type_k} V {type_v}, flash_attn {flash_attn}; llama.cpp's error log says why)")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ptr))
        self.kv_unified = kv_unified
        # cells one sequence can use: all of them (unified) or its own stream's share
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self.ptr))
        self.n_seq_max = n_seq_max
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(self.ptr))
        self.n_batch = n_batch
        self.n_threads = n_threads
        # as llama.cpp took them (it clamps n_ubatch to n_batch)
        self.n_threads_batch = int(llama_cpp.llama_n_threads_batch(self.ptr))
        self.n_ubatch = int(llama_cpp.llama_n_ubatch(self.ptr))
        self.type_k, self.type_v = type_k, type_v
        self.flash_attn = flash_attn
        self.mem = llama_cpp.llama_get_memory(self.ptr)
        # whether positions can be shifted (context shift): not for recurrent or hybrid memory, nor M-RoPE models
        self.can_shift = bool(llama_cpp.llama_memory_can_shift(self.mem))
        self.batch = Batch(n_batch, max_seqs=n_seq_max)
        # cross-stream copies llama.cpp has not made yet (seq_cp): destination -> source
        self._unsettled: dict[int, int] = {}
        self._settle_batch: Batch | None = None
        self.lock = threading.RLock()
        self.n_decodes = 0
        self._logits_view: np.ndarray | None = None  # logits(): the output buffer's view and its address
        self._logits_addr: int | None = None
        # exact mode = batch-invariant kernels; the llamafile switch is
        # process-wide, so each decode asserts its context's setting
        self.exact = exact
        if exact:
            ok, why = lib.exact_mode_available()
            if not ok:
                raise RuntimeError(f"exact mode unavailable: {why}")
            if flash_attn:
                raise ValueError("exact mode needs flash attention off")
            if model.use_extra_bufts:
                raise ValueError(
                    "exact mode needs the model loaded with use_extra_bufts=False "
                    "(repacked K-quant kernels switch paths by batch size)"
                )

    @property
    def attention_tile_rows(self) -> int:
        """Rows from which a decode's attention runs llama.cpp's tiled CPU flash-attention kernel: flash attention
        on, the model's layers (so the KV cache and attention) on the CPU, F16 or F32 K and V of one type, one
        KV pool (with a stream per slot the kernel sees each stream's rows apart). 0 where no such threshold
        applies (a GPU, flash attention off, quantized caches)."""
        tiled_types = self.type_k == self.type_v and self.type_k in ("f16", "f32")
        on_cpu = self.model.n_gpu_layers == 0
        return CPU_FA_TILE_ROWS if self.flash_attn and on_cpu and tiled_types and self.kv_unified else 0

    # ---- decode --------------------------------------------------------------
    def decode(self, batch: Batch | None = None) -> np.ndarray:
        """Decode `batch` (default: self.batch). Returns the logits of the rows
        that asked for them, in batch order: a [n_outputs, n_vocab] float32 view
        into llama.cpp's buffer, valid until the next decode."""
        b = batch or self.batch
        self.launch(b)
        return self.logits(b.n_outputs)

    def launch(self, batch: Batch | None = None) -> None:
        """Start decoding `batch` (default: self.batch); `logits` then waits for it. llama_decode returns once
        a GPU backend has queued the graph (llama.cpp synchronises when an output is read), so host work done
        between the two overlaps the device's; on the CPU backend it returns when the decode is done. Nothing
        may touch this context (KV, batch, another decode) in between."""
        b = batch or self.batch
        if b.n_tokens == 0:
            raise DecodeError("empty batch")
        if b.n_tokens > self.n_batch:
            raise DecodeError(f"batch of {b.n_tokens} tokens exceeds n_batch {self.n_batch}")
        lib.set_llamafile(not self.exact)
        if threading.get_ident() != decode_threads.last_ident:  # a new decoding thread: OpenMP cares
            decode_threads.note()
        rc = llama_cpp.llama_decode(self.ptr, b.as_struct())
        self.n_decodes += 1
        if rc in (0, 1):  # llama.cpp made the pending stream copies before it looked for cells
            self._unsettled.clear()
        if rc != 0:
            raise DecodeError(
                "llama_decode failed: " + ("no KV cache slot for the batch (context full)" if rc == 1 else f"code {rc}")
            )

    def logits(self, n_outputs: int) -> np.ndarray:
        """The last decode's first `n_outputs` logits rows (waiting for a device still computing them): a
        [n_outputs, n_vocab] float32 view into llama.cpp's buffer, valid until the next decode."""
        if n_outputs == 0:
            return np.zeros((0, self.model.n_vocab), dtype=np.float32)
        addr = _logits_address(self.ptr)
        # a view of llama.cpp's output buffer, made again only when the buffer moved or grew: building it
        # (np.ctypeslib.as_array) is not free, and would be paid on every round
        view = self._logits_view
        if view is None or self._logits_addr != addr or len(view) < n_outputs:
            if not addr:
                raise DecodeError("llama.cpp returned no logits buffer")
            ptr = ctypes.cast(addr, ctypes.POINTER(ctypes.c_float))
            view = self._logits_view = np.ctypeslib.as_array(ptr, shape=(n_outputs, self.model.n_vocab))
            self._logits_addr = addr
        return view[:n_outputs]

    # ---- backend sampling ----------------------------------------------------
    def set_greedy_backend(self, seq_id: int, on: bool) -> None:
        """llama.cpp picks seq_id's top token per output row inside the decode graph (an argmax node per row;
        `sampled_tokens` reads them) instead of the host reading full vocabulary rows. While every output row of
        a batch has one, llama.cpp copies no logits at all. Changes the graph: set it between requests, not rounds.
        More than one output row of a sequence per batch needs `outputs_per_seq` at construction."""
        old = self._samplers.pop(seq_id, None)
        if on:
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            if not llama_cpp.llama_set_sampler(self.ptr, seq_id, chain):
                llama_cpp.llama_sampler_free(chain)
                raise RuntimeError(f"llama.cpp cannot run a greedy sampler for sequence {seq_id} on this backend")
            self._samplers[seq_id] = chain
        elif old is not None:
            llama_cpp.llama_set_sampler(self.ptr, seq_id, None)
        if old is not None:  # the context held it until the line above replaced or dropped it
            llama_cpp.llama_sampler_free(old)

    def sampled_tokens(self, batch_indices) -> np.ndarray:
        """The backend sampler's token at each batch index (rows of sequences with `set_greedy_backend`)."""
        get = llama_cpp.llama_get_sampled_token_ith
        out = np.fromiter((get(self.ptr, int(i)) for i in batch_indices), dtype=np.int32)
        if (out < 0).any():
            raise DecodeError("llama.cpp returned no sampled token for a row (no backend sampler on its sequence?)")
        return out

    # ---- KV cache per sequence ----------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id's cells with positions in [p0, p1) (-1 = open end)."""
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Let dst see src's cells in [p0, p1). In one KV stream that is metadata only. Across streams (exact
        mode) llama.cpp copies the metadata now but the K/V buffer at the next decode, so until then a save of
        dst would read the old buffer and a restore into src would change what dst gets: `save_seq`,
        `load_seq` and `state_seq_set` settle such a copy first (`settle`)."""
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        if not self.kv_unified and src != dst and self.model.memory_kind == "attention":
            # (recurrent state is copied at once; a hybrid's settling decode would advance its recurrent part)
            self._unsettled[dst] = src

    def settle(self, seq_id: int | None = None) -> None:
        """Make every cross-stream copy that involves seq_id (None: any) real now: a one-token decode in one
        copy's destination, whose cell is removed again. llama.cpp makes all pending copies at the start of
        any decode and has no other call for it."""
        if not self._unsettled or (seq_id is not None and seq_id not in self._unsettled
                                   and seq_id not in self._unsettled.values()):
            return
        dst = next(iter(self._unsettled))
        pos = self.seq_pos_max(dst) + 1
        if self._settle_batch is None:
            self._settle_batch = Batch(1)
        b = self._settle_batch
        b.clear()
        b.add_seq(dst, np.zeros(1, dtype=np.int32), pos, 1)
        self.decode(b)
        self.seq_rm(dst, pos, -1)

    def seq_keep(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_keep(self.mem, seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add `delta` to the positions of seq_id's cells in [p0, p1) (-1 = open end); llama.cpp re-rotates
        their keys (RoPE) at the next decode."""
        llama_cpp.llama_memory_seq_add(self.mem, seq_id, p0, p1, delta)

    def shift_seq(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        """Context shift (llama-server's): drop seq_id's cells [n_keep, n_keep + n_discard) and move the later
        ones back by n_discard. False, changing nothing, where the memory cannot shift positions."""
        if not self.can_shift or not self.seq_rm(seq_id, n_keep, n_keep + n_discard):
            return False
        self.seq_add(seq_id, n_keep + n_discard, -1, -n_discard)
        return True

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id in the cache, -1 if empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_min(self.mem, seq_id))

    def clear_seq(self, seq_id: int) -> None:
        self.seq_rm(seq_id, -1, -1)

    def clear_all(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    # ---- state checkpoints per sequence ------------------------------------------
    def state_seq_get(self, seq_id: int) -> bytes:
        """A checkpoint of one sequence (its KV cells, or recurrent state)."""
        saved = self.save_seq(seq_id, allocate=host_buffer)  # copied out and dropped: it takes no kept buffer
        return b"" if saved is None else saved.to_bytes()

    def save_seq(self, seq_id: int, allocate: Callable[[int], ctypes.Array] | None = None) -> SavedCells | None:
        """seq_id's cells saved to host memory (the prompt cache's host tier), which `load_seq` takes back
        without another copy; None where llama.cpp wrote nothing. `allocate(size)`: the buffer (default: one
        from `saved_buffers`, the buffers of saves given back to `recycle`, or a new host_memory.host_buffer:
        the save runs on the round thread, and a buffer whose pages are in makes it the copy alone)."""
        self.settle(seq_id)
        size = int(llama_cpp.llama_state_seq_get_size(self.ptr, seq_id))
        buf = (allocate or self.saved_buffers.take)(size)
        n = int(llama_cpp.llama_state_seq_get_data(self.ptr, buf, size, seq_id))
        return SavedCells(buf, n) if n > 0 else None

    def recycle(self, saved: SavedCells) -> None:
        """A `save_seq` result nobody will restore any more: its buffer may serve a later save (a few are kept:
        `recycled_bytes`)."""
        self.saved_buffers.give(saved)

    def recycled_bytes(self) -> int:
        """Host memory in the buffers `recycle` keeps for later saves."""
        return self.saved_buffers.held_bytes

    def load_seq(self, seq_id: int, saved: SavedCells) -> bool:
        """Write a `save_seq` result into seq_id (cleared first). False, with seq_id left empty, where llama.cpp
        refuses it (no run of free cells long enough)."""
        self.settle(seq_id)
        self.clear_seq(seq_id)
        if int(llama_cpp.llama_state_seq_set_data(self.ptr, saved.buffer, saved.n_bytes, seq_id)) == 0:
            self.clear_seq(seq_id)
            return False
        return True

    def state_seq_set(self, seq_id: int, data: bytes) -> None:
        """Restore a checkpoint into seq_id (which should be empty first)."""
        self.settle(seq_id)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(llama_cpp.llama_state_seq_set_data(self.ptr, buf, len(data), seq_id)) == 0:
            raise RuntimeError(f"llama.cpp failed to restore the state of sequence {seq_id}")

    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
        for chain in getattr(self, "_samplers", {}).values():  # after the context that used them
            llama_cpp.llama_sampler_free(chain)
        self._samplers = {}

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
