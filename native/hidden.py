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
import logging
import threading

import llama_cpp
import numpy as np

from specray.engine.hidden_rows import ROW_DTYPE, TAP_NEXTN, Tap

from . import decode_threads, ext, lib
from .context import Context, DecodeError
from .model import Model
from .slot_backend import SlotBackend, top_token_probs

log = logging.getLogger("specray.companion")

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
        if threading.get_ident() != decode_threads.last_ident:  # as Context.decode: OpenMP's pools are per thread
            decode_threads.note()
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
#: (all-or-none mode, where the head's graph cannot output a subset: PairHead)
PRE_BATCH_PAIRS = 8
#: relative L2 distance between a subset output's logits row and the same row of an all-outputs batch above
#: which the head's graph is taken to mishandle output subsets: the fault gives another pair's rows (a distance
#: near 1.5), a right graph differs by 1e-7 or less
SUBSET_TOLERANCE = 0.1


def _rel_dist(a: np.ndarray, b: np.ndarray) -> float:
    """|b - a| / |a| over a's finite entries (a reduced draft vocabulary leaves -inf outside it); inf where the
    two rows are not finite in the same places.

    >>> _rel_dist(np.array([3.0, 4.0, -np.inf]), np.array([3.0, 4.5, -np.inf]))
    0.1
    """
    fin = np.isfinite(a)
    if not np.array_equal(fin, np.isfinite(b)):
        return float("inf")
    return float(np.linalg.norm(b[fin] - a[fin]) / max(float(np.linalg.norm(a[fin])), 1e-12))


class PairHead(SlotBackend):
    """A head context fed (token, row) pairs, one sequence per slot (the HiddenBackend of hidden_base.py).

    Its own output row per output pair (h_nextn of the head: masked, outputs only) is what the next draft step
    feeds back.

    Output subsets. The vendored llama.cpp's eagle3 graph applied no output-id selection: given a batch whose
    outputs were a subset of its pairs, it returned the rows of the batch's first pairs (a catch-up's draft
    then continued the batch's first pair, in the system prompt, not its last). The MTP graphs got the logits
    right but the output rows, which the next draft step feeds back, wrong the same way (they set the row
    tensor before selecting the outputs, and the masked copy-out took its first rows). specray's build fixes both
    (native/patches/llama-eagle3-output-rows.patch, llama-nextn-masked-rows.patch). A build without them (a
    plain PyPI wheel) still gives right drafts: at start a head decodes one probe both ways
    (`subset_outputs_ok`) and, where they differ, every batch has all of its pairs output, or none."""

    taps: tuple[Tap, ...] = ()

    def __init__(self, model: Model, ctx: Context, width: int) -> None:
        super().__init__(model, ctx)
        self.width = width
        self.batch = PairBatch(ctx)
        ext.llama_set_embeddings_nextn(ctx.ptr, True, True)  # the head's own output row, for output pairs
        self.n_out_embd = int(ext.llama_model_n_embd_out(model.ptr))
        self.pairs = 0
        self.subset_outputs = False
        self.subset_outputs_ok()  # a few ms: two 4-pair decodes on slot 0, which starts empty

    def subset_outputs_ok(self, slot: int = 0, n: int = 4) -> bool:
        """Whether this head's graph outputs a subset of a batch's pairs right: `n` pairs on `slot` (left empty
        again), once with every pair outputting and once with only the last, must give the last pair the same
        logits row and output row. Sets `subset_outputs`, which decode() then uses."""
        rng = np.random.default_rng(0)
        toks = (np.arange(n, dtype=np.int32) * 37 + 11) % min(self.model.n_vocab, 1000)
        rows = rng.standard_normal((n, self.width)).astype(ROW_DTYPE)
        got = []
        for outputs in (n, 1):
            self.ctx.clear_seq(slot)
            self.batch.clear()
            self.batch.add_pairs(slot, toks, 0, rows, outputs)
            self.batch.process()
            hid = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(self.ctx.ptr), shape=(outputs, self.n_out_embd))
            got.append((self.ctx.logits(outputs)[-1].astype(np.float64), hid[-1].astype(np.float64)))
        self.ctx.clear_seq(slot)
        self.batch.clear()
        dist = max(_rel_dist(a, b) for a, b in zip(*got))  # the logits row and the head's own output row
        self.subset_outputs = dist <= SUBSET_TOLERANCE
        if not self.subset_outputs:  # right drafts all the same, at the cost of LM-head rows nobody reads
            log.warning("%s: this llama.cpp build's head graph gives a subset of outputs the wrong rows (relative "
                        "distance %.3g): every head batch outputs all of its pairs or none, which costs LM-head "
                        "rows (specray's build has the fix: scripts/build-llama-cpp.sh)", self.model.name, dist)
        return self.subset_outputs

    def encode(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def decode(self, runs: list[tuple[int, np.ndarray, int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each run's last pair is read. With `subset_outputs` the runs go in one batch where only those pairs
        output (the LM head computes their rows alone). Without (the graph mishandles subsets): every batch has
        all of its pairs output or none; a catch-up (more than PRE_BATCH_PAIRS pairs before the runs' last)
        decodes those pairs first with no outputs, a steady draft's extra pair or two output and are dropped."""
        if self.subset_outputs:
            return self._feed(runs, "last")
        lead = sum(len(toks) - 1 for _, toks, _, _ in runs)
        if lead > PRE_BATCH_PAIRS:
            self._feed([(s, t[:-1], p, r[:-1]) for s, t, p, r in runs if len(t) > 1], "none")
            runs = [(s, t[-1:], p + len(t) - 1, r[-1:]) for s, t, p, r in runs]
        return self._feed(runs, "all")

    def _feed(self, runs: list[tuple[int, np.ndarray, int, np.ndarray]],
              outputs: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode the runs' pairs, as many batches as n_batch needs. `outputs`: "all" (every pair), "last" (each
        run's last pair) or "none"; returns each run's last pair's top token, its probability and output row."""
        top = np.zeros(len(runs), dtype=np.int32)
        prob = np.zeros(len(runs), dtype=np.float64)
        hid = np.zeros((len(runs), self.n_out_embd), dtype=ROW_DTYPE)
        b = self.batch
        b.clear()
        owners: list[tuple[int, int]] = []  # (run, its last pair's row in the batch's outputs)

        def flush() -> None:
            if b.n_tokens == 0:
                return
            n, n_out = b.n_tokens, b.n_outputs
            b.process()
            self.n_decodes += 1
            self.pairs += n
            if owners:
                ri = [r for r, _ in owners]
                at = [i for _, i in owners]
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx.ptr), shape=(n_out, self.model.n_vocab))
                t, p = top_token_probs(logits[at])
                top[ri], prob[ri] = t, p
                hid[ri] = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(self.ctx.ptr),
                                                shape=(n_out, self.n_out_embd))[at]
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
                last = off + take == n
                k = take if outputs == "all" else (1 if outputs == "last" and last else 0)
                b.add_pairs(seq_id, toks[off : off + take], pos0 + off, rows[off : off + take], k)
                if outputs != "none" and last:
                    owners.append((ri, b.n_outputs - 1))  # outputs are rows in batch order
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
