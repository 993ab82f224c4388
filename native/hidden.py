"""Hidden rows in and out of llama contexts.

`HiddenOutput` (target side) switches a context's hidden-row taps on and off
and reads them after a decode: "nextn" (the final hidden state llama.cpp
calls h_nextn, for every token of the batch) and layer inputs (the input of
target layer `lid`, for every token). Taps cost compute and memory only while
on (`set_enabled`), so a target with no hidden-state speculator pays nothing.

`PairBatch` and `PairHead` (companion side) feed a head (an MTP context, an
EAGLE-3 draft) pairs of (token, row) through llama.cpp's extended batch API
(`llama_batch_ext` + `llama_process`), the only way to give a token and an
embedding row together, and read back the head's logits and output rows.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from specray.engine.hidden_rows import ROW_DTYPE, TAP_NEXTN, Tap

from . import ext, lib
from .context import Context, DecodeError
from .model import Model
from .slot_backend import SlotBackend, top_token_probs

#: architectures whose trunk graph outputs h_nextn (src/models/*.cpp setting res->t_h_nextn)
NEXTN_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "gemma4", "glm4moe", "glm5-next", "glm-dsa",
    "hy_v3", "mimo2", "nemotron_h", "nemotron_h_moe", "gpt-oss", "qwen35", "qwen35moe", "qwen3next", "step35"})
#: architectures whose graph records each layer's input (src/models/*.cpp setting res->t_layer_inp[il]);
#: asking another one for a layer input aborts the process inside llama.cpp, so it is refused here
LAYER_INP_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01", "minimax-m2",
    "muse-glimmer", "nanbeige", "nemotron_h", "gpt-oss", "qwen35", "qwen35moe", "qwen3", "qwen3moe", "qwen3next",
    "qwen4exp"})


def model_arch(model: Model) -> str:
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_model_meta_val_str(model.ptr, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n >= 0 else ""


def tap_widths(model: Model, taps: tuple[Tap, ...]) -> tuple[int, ...]:
    """Row width of each tap on `model`; ValueError for a tap the model's graph cannot output."""
    arch = model_arch(model)
    n_layer = int(llama_cpp.llama_model_n_layer(model.ptr))
    widths = []
    for tap in taps:
        if tap == TAP_NEXTN:
            if arch not in NEXTN_ARCHS:
                raise ValueError(f"model {model.name} ({arch}) has no final hidden-state output (h_nextn) in this "
                                 f"llama.cpp; MTP targets: {', '.join(sorted(NEXTN_ARCHS))}")
            widths.append(int(ext.llama_model_n_embd_out(model.ptr)))
        elif isinstance(tap, int) and 0 <= tap < n_layer:
            if arch not in LAYER_INP_ARCHS:
                raise ValueError(f"model {model.name} ({arch}) cannot output layer inputs in this llama.cpp; "
                                 f"EAGLE-3 targets: {', '.join(sorted(LAYER_INP_ARCHS))}")
            widths.append(int(llama_cpp.llama_model_n_embd(model.ptr)))
        else:
            # (llama.cpp's EAGLE-3 reads id n_layer from h_nextn; not supported here: name "nextn" instead)
            raise ValueError(f"hidden tap {tap!r}: expected {TAP_NEXTN!r} or a layer id in [0, {n_layer})")
    return tuple(widths)


class HiddenOutput:
    """The hidden-row taps of a target context (not thread-safe: the target's lock covers it)."""

    def __init__(self, ctx: Context, taps: tuple[Tap, ...]) -> None:
        if not taps:
            raise ValueError("no hidden taps")
        self.ctx = ctx
        self.taps = tuple(taps)
        if len(set(self.taps)) != len(self.taps):
            raise ValueError(f"duplicate hidden taps {self.taps}")
        self.tap_widths = tap_widths(ctx.model, self.taps)
        self.width = sum(self.tap_widths)
        self.enabled = False
        self.switches = 0  # on/off changes (each changes the graph llama.cpp builds)

    def set_enabled(self, on: bool) -> None:
        if on == self.enabled:
            return
        for tap in self.taps:
            if tap == TAP_NEXTN:
                # unmasked: a row for every token of the batch, not only the ones that output logits
                ext.llama_set_embeddings_nextn(self.ctx.ptr, on, False)
            else:
                ext.llama_set_embeddings_layer_inp(self.ctx.ptr, tap, on)
        self.enabled = on
        self.switches += 1

    def rows(self, n_tokens: int) -> np.ndarray:
        """[n_tokens, width] rows of the last decode, in batch order. One tap: a view into llama.cpp's buffer
        (valid until the next decode); several: their concatenation."""
        if not self.enabled:
            raise RuntimeError("hidden taps are off")
        parts = []
        for tap, w in zip(self.taps, self.tap_widths):
            ptr = (ext.llama_get_embeddings_nextn(self.ctx.ptr) if tap == TAP_NEXTN
                   else ext.llama_get_embeddings_layer_inp(self.ctx.ptr, tap))
            if not ptr:
                raise DecodeError(f"llama.cpp returned no rows for hidden tap {tap!r}")
            parts.append(np.ctypeslib.as_array(ptr, shape=(n_tokens, w)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


_float_p = ctypes.POINTER(ctypes.c_float)
_add_token = llama_cpp.llama_batch_ext_add_token
_add_embd = llama_cpp.llama_batch_ext_add_embd
_set_pos = llama_cpp.llama_batch_ext_set_pos
_set_embd = llama_cpp.llama_batch_ext_set_embd_token
_set_out = llama_cpp.llama_batch_ext_set_output_logits


class PairBatch:
    """A llama_batch_ext holding (token, row) pairs, or rows alone (an encoder's input)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ptr = llama_cpp.llama_batch_ext_init(ctx.ptr)
        if not self.ptr:
            raise RuntimeError("llama_batch_ext_init failed")
        self.capacity = ctx.n_batch
        self.n_tokens = 0
        self.n_outputs = 0
        self._pos = (llama_cpp.llama_pos * 4)()

    def clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self.ptr)
        self.n_tokens = 0
        self.n_outputs = 0

    def _entry(self, idx: int, pos: int, row_ptr: int, width: int, output: bool, with_token: bool) -> None:
        if idx < 0:
            raise DecodeError(f"llama_batch_ext rejected an entry (code {idx}; capacity {self.capacity})")
        self._pos[0] = pos
        _set_pos(self.ptr, idx, self._pos)
        if with_token and not _set_embd(self.ptr, idx, llama_cpp.llama_embd(ctypes.cast(row_ptr, _float_p), 1, width)):
            raise DecodeError(f"row of width {width} does not fit the head's input")
        _set_out(self.ptr, idx, output)
        self.n_tokens += 1
        self.n_outputs += int(output)

    def add_pairs(self, seq_id: int, tokens: np.ndarray, pos0: int, rows: np.ndarray, n_outputs: int) -> None:
        """tokens[j] with rows[j] at position pos0 + j; the last n_outputs pairs output logits and rows."""
        rows = np.ascontiguousarray(rows, dtype=ROW_DTYPE)
        base, stride, width = rows.ctypes.data, rows.strides[0], rows.shape[1]
        n = len(tokens)
        for j in range(n):
            idx = _add_token(self.ptr, seq_id, int(tokens[j]))
            self._entry(idx, pos0 + j, base + j * stride, width, j >= n - n_outputs, True)

    def add_rows(self, seq_id: int, rows: np.ndarray, pos0: int, output: bool = True) -> None:
        """Row-only entries (an encoder's input, a DFlash draft's features), each with an output unless not
        `output`."""
        rows = np.ascontiguousarray(rows, dtype=ROW_DTYPE)
        base, stride, width = rows.ctypes.data, rows.strides[0], rows.shape[1]
        for j in range(len(rows)):
            e = llama_cpp.llama_embd(ctypes.cast(base + j * stride, _float_p), 1, width)
            self._entry(_add_embd(self.ptr, seq_id, e), pos0 + j, 0, width, output, False)

    def add_tokens(self, seq_id: int, tokens: np.ndarray, pos0: int, first_output: int) -> None:
        """Token-only entries at pos0...; those from index first_output on output logits."""
        for j in range(len(tokens)):
            self._entry(_add_token(self.ptr, seq_id, int(tokens[j])), pos0 + j, 0, 0, j >= first_output, False)

    def process(self, encode: bool = False) -> None:
        lib.set_llamafile(not self.ctx.exact)
        kind = llama_cpp.LLAMA_PROCESS_TYPE_ENCODE if encode else llama_cpp.LLAMA_PROCESS_TYPE_DECODE
        rc = llama_cpp.llama_process(self.ctx.ptr, kind, self.ptr)
        self.ctx.n_decodes += 1
        if rc != 0:
            why = "no KV cache slot (context full)" if rc == 1 else f"code {rc}"
            raise DecodeError(f"llama_process failed: {why}")

    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_batch_ext_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


#: a head decode with more pairs than this before its runs' last ones decodes them first, with no outputs
PRE_BATCH_PAIRS = 8


class PairHead(SlotBackend):
    """A head context fed (token, row) pairs, one sequence per slot (the HiddenBackend of hidden_base.py).

    Its own output row per output pair (h_nextn of the head: masked, outputs only) is what the next draft step
    feeds back."""

    taps: tuple[Tap, ...] = ()

    def __init__(self, model: Model, ctx: Context, width: int) -> None:
        super().__init__(model, ctx)
        self.width = width
        self.batch = PairBatch(ctx)
        ext.llama_set_embeddings_nextn(ctx.ptr, True, True)  # the head's own output row, for output pairs
        self.n_out_embd = int(ext.llama_model_n_embd_out(model.ptr))
        self.pairs = 0

    def encode(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def decode(self, runs: list[tuple[int, np.ndarray, int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each run's last pair is read; every batch has all of its pairs output, or none. A batch whose outputs
        are a subset of its pairs (llama.cpp's output-id selection) gave the first pairs' outputs in place of
        the last ones with this vendored llama.cpp's eagle3 graph: a head's catch-up draft was the system
        prompt's next token, 198 on every SmolLM2 chat prompt, and so was every draft after a round that kept a
        draft token (two pairs to decode). Measured against the torch module of a trained head: 80% of served
        drafts agreed with it, 98% after. A catch-up (more than PRE_BATCH_PAIRS pairs before the runs' last)
        decodes those pairs first with no outputs, so it pays no LM-head rows; a steady draft's extra pair or
        two output in the one batch, cheaper than a second decode call."""
        lead = sum(len(toks) - 1 for _, toks, _, _ in runs)
        if lead > PRE_BATCH_PAIRS:
            self._feed([(s, t[:-1], p, r[:-1]) for s, t, p, r in runs if len(t) > 1], outputs=False)
            runs = [(s, t[-1:], p + len(t) - 1, r[-1:]) for s, t, p, r in runs]
        return self._feed(runs, outputs=True)

    def _feed(self, runs: list[tuple[int, np.ndarray, int, np.ndarray]],
              outputs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        top = np.zeros(len(runs), dtype=np.int32)
        prob = np.zeros(len(runs), dtype=np.float64)
        hid = np.zeros((len(runs), self.n_out_embd), dtype=ROW_DTYPE)
        b = self.batch
        b.clear()
        owners: list[tuple[int, int]] = []  # (run, batch index of its last pair)

        def flush() -> None:
            if b.n_tokens == 0:
                return
            n = b.n_tokens
            b.process()
            self.n_decodes += 1
            self.pairs += n
            if owners:
                ri = [r for r, _ in owners]
                at = [i for _, i in owners]
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx.ptr), shape=(n, self.model.n_vocab))
                t, p = top_token_probs(logits[at])
                top[ri], prob[ri] = t, p
                hid[ri] = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(self.ctx.ptr),
                                                shape=(n, self.n_out_embd))[at]
            owners.clear()
            b.clear()

        for ri, (seq_id, toks, pos0, rows) in enumerate(runs):
            off, n = 0, len(toks)
            while off < n:
                room = self.n_batch - b.n_tokens
                if room == 0:
                    flush()
                    room = self.n_batch
                take = min(room, n - off)
                b.add_pairs(seq_id, toks[off : off + take], pos0 + off, rows[off : off + take],
                            take if outputs else 0)
                if outputs and off + take == n:
                    owners.append((ri, b.n_tokens - 1))
                off += take
        flush()
        return top, prob, hid

    def measure_decode_costs(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16), reps: int = 3,
                             prefix: int = 32) -> dict[int, float]:
        """Seconds per head decode of n pairs (n sequences, one pair each, after a `prefix`-pair context)."""
        ids = (np.arange(prefix, dtype=np.int32) * 7 + 100) % 1000 + 10
        rows = np.zeros((prefix, self.width), dtype=ROW_DTYPE)
        b = self.batch
        return self._measure_step_costs(
            sizes, reps, prefix,
            prime=lambda seqs: self.decode([(s, ids, 0, rows) for s in seqs]), clear=b.clear,
            add_row=lambda s, i, pos: b.add_pairs(s, ids[i : i + 1], pos, rows[:1], 1), run=b.process)

    def info(self) -> dict:
        return {"model": self.model.name, "description": self.model.description, "taps": list(self.taps),
                "width": self.width, "n_ctx": self.ctx.n_ctx,
                "decode_cost_ms": {k: v * 1000 for k, v in self._costs.items()}}

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
