"""A synthetic llama-architecture target of a chosen size: realistic step times where no large model can be had.

No 1-3B model can be fetched on the offline GPU machine, and a 135M model's
decode is too cheap there for the verify cost curve to look like a real
target's. `write_synthetic_llama` writes a llama GGUF of about the requested
parameter count with a real model's vocabulary, tokenizer and chat template
(SmolLM2's by default), and seeded random weights: 1/sqrt(fan_in) projections,
unit-RMS embeddings, the blocks' output projections scaled by 1/sqrt(2
n_layer) so the residual stream stays near unit RMS however deep the model is
(activations stay finite in f16), and an LM head of its own whose logits have
a standard deviation of about 2. (A head tied to the embedding, as SmolLM2's
is, ranks the last token first, since the residual stream still carries it:
greedy decoding then repeats one token forever.) Greedy text wanders through
the vocabulary, deterministic for a seed.

Its text is meaningless, so acceptance rates on it mean nothing; what it is for
is step time: cost(k)/cost(1) of a k-token verify, and a round's host
overhead against a realistic decode. Every figure from such a model is
labelled synthetic (`is_synthetic`, and `specray cost-curve` prints it).

    specray synth-model --params 1.5B --out /tmp/synth-1.5b.gguf    # ~1.6 GB in q8_0 (f16: 3 GB)
    specray cost-curve --model /tmp/synth-1.5b.gguf                # cost(k)/cost(1), k = 1..16

Weights are generated and written one tensor at a time (the largest, the
embedding, is n_vocab x n_embd floats), so memory stays well under the file's
size: here a 300M q8_0 one took 6 s of CPU (20 s a billion parameters, plus
writing the file).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .gguf_meta import read_metadata
from .models import resolve_model
from .synthetic_gguf import copy_fields, vocab_fields

LLAMA = "llama"
NAME_PREFIX = "specray synthetic llama"
#: --type -> ggml type name (quantized in numpy by the gguf package)
TYPES = ("f16", "q8_0", "q4_0")
_WIDTHS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096)


@dataclass(frozen=True)
class LlamaShape:
    """A llama block stack: GQA attention (head_dim 64, or n_embd below that, up to n_embd 1024, then 128; a
    quarter as many KV heads), SwiGLU FFN, an untied LM head."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        return min(64, self.n_embd) if self.n_embd <= 1024 else 128

    @property
    def n_head(self) -> int:
        return max(1, self.n_embd // self.head_dim)

    @property
    def n_head_kv(self) -> int:
        return max(1, self.n_head // 4)

    def layer_params(self, n_ff: int | None = None) -> int:
        e, kv = self.n_embd, self.n_head_kv * self.head_dim
        q = self.n_head * self.head_dim
        return 2 * e * q + 2 * e * kv + 3 * e * (self.n_ff if n_ff is None else n_ff) + 2 * e

    @property
    def params(self) -> int:
        """Every weight: the embedding and the LM head, the blocks, the final norm."""
        return 2 * self.n_vocab * self.n_embd + self.n_layer * self.layer_params() + self.n_embd


def parse_count(text: str) -> int:
    """A parameter count: 1.5B, 300M, 4m, 2e9, 1500000.

    >>> [parse_count(t) for t in ("1.5B", "300M", "4m", "2e9", "1500000")]
    [1500000000, 300000000, 4000000, 2000000000, 1500000]
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbB]?)\s*", text)
    if not m:
        raise ValueError(f"expected a parameter count like 1.5B, 300M or 2e9, got {text!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[m.group(2).lower()]
    return int(round(float(m.group(1)) * scale))


def shape_for_params(params: int, n_vocab: int) -> LlamaShape:
    """The shape of about `params` weights: the width whose depth comes closest to n_embd / 64 layers (SmolLM2-1.7B:
    2048 x 24), then n_ff (a multiple of 32, about 4 n_embd) chosen to land on the count.

    >>> s = shape_for_params(1_500_000_000, 49152)
    >>> (s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.n_ff, abs(s.params / 1.5e9 - 1) < 0.01)
    (2048, 21, 16, 4, 8352, True)
    >>> s = shape_for_params(16_000_000, 49152)      # a test's: mostly embedding and LM head
    >>> (s.n_embd, s.n_layer, s.n_head, s.n_head_kv, abs(s.params / 16e6 - 1) < 0.01)
    (128, 13, 2, 1, True)
    """
    best: tuple[float, LlamaShape] | None = None
    for e in _WIDTHS:
        probe = LlamaShape(n_vocab, e, 1, 4 * e)
        left = params - 2 * n_vocab * e - e
        n_layer = left // probe.layer_params()
        if n_layer < 1:
            continue
        # n_ff absorbs what whole layers leave over: 3 e n_ff per layer
        fixed = probe.layer_params(n_ff=0)
        n_ff = max(32, int(round((left / n_layer - fixed) / (3 * e) / 32)) * 32)
        shape = LlamaShape(n_vocab, e, int(n_layer), n_ff)
        score = abs(math.log(n_layer * 64 / e))
        if best is None or score < best[0]:
            best = (score, shape)
    if best is None:
        raise ValueError(f"{params} parameters do not hold even the {n_vocab}-token embedding and one layer")
    return best[1]


def is_synthetic(path: str) -> bool:
    """True for a GGUF this module wrote (its general.name): figures from it are to be labelled synthetic."""
    name = read_metadata(path).get("general.name")
    return bool(name) and str(name[1]).startswith(NAME_PREFIX)


def _tensor_plan(s: LlamaShape) -> list[tuple[str, tuple[int, int] | tuple[int], float]]:
    """(name, numpy shape, scale) in file order; scale 0 = a norm (ones), -1 = the embedding (unit-RMS rows),
    else entries of standard deviation scale / sqrt(fan_in)."""
    q, kv, e = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_embd
    out_scale = 1.0 / math.sqrt(2 * s.n_layer)
    plan: list[tuple[str, tuple[int, int] | tuple[int], float]] = [("token_embd.weight", (s.n_vocab, e), -1.0)]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (e,), 0.0), (b + "attn_q.weight", (q, e), 1.0),
                 (b + "attn_k.weight", (kv, e), 1.0), (b + "attn_v.weight", (kv, e), 1.0),
                 (b + "attn_output.weight", (e, q), out_scale), (b + "ffn_norm.weight", (e,), 0.0),
                 (b + "ffn_gate.weight", (s.n_ff, e), 1.0), (b + "ffn_up.weight", (s.n_ff, e), 1.0),
                 (b + "ffn_down.weight", (e, s.n_ff), out_scale)]
    return plan + [("output_norm.weight", (e,), 0.0), ("output.weight", (s.n_vocab, e), 2.0)]


def _weights(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    if scale == 0.0:
        return np.ones(shape, dtype=np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)
    if scale < 0:  # embedding rows of RMS 1
        return w / np.sqrt((w * w).mean(axis=1, keepdims=True))
    return w * np.float32(scale / math.sqrt(shape[1]))


def _qtype(wtype: str, ndim: int):
    """The ggml type a tensor is stored in: norms (1-D) f32, matrices `wtype` (None: a numpy dtype says it)."""
    import gguf

    if ndim == 1 or wtype == "f16":
        return None
    return {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[wtype]


def _encode(w: np.ndarray, wtype: str) -> np.ndarray:
    import gguf

    qtype = _qtype(wtype, w.ndim)
    if qtype is not None:
        return gguf.quants.quantize(w, qtype)
    return w.astype(np.float16) if w.ndim == 2 else w


def _nbytes(shape, wtype: str) -> int:
    import gguf

    n = int(np.prod(shape))
    qtype = _qtype(wtype, len(shape))
    if qtype is None:
        return (2 if len(shape) == 2 else 4) * n
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return n // block * size


def write_synthetic_llama(path: str, params: int, *, wtype: str = "q8_0", vocab_from: str = "smollm2-135m",
                          seed: int = 0, n_ctx_train: int = 8192,
                          progress: Callable[[str], None] | None = None) -> LlamaShape:
    """Write a llama GGUF of about `params` weights to `path` (replaced atomically); returns its shape."""
    import gguf

    if wtype not in TYPES:
        raise ValueError(f"weight type must be one of {', '.join(TYPES)}, got {wtype!r}")
    vocab = vocab_fields(vocab_from)
    n_vocab = len(read_metadata(vocab_from)["tokenizer.ggml.tokens"][1])
    s = shape_for_params(params, n_vocab)
    if wtype != "f16" and (s.n_embd % 32 or s.n_ff % 32):  # pragma: no cover - widths and n_ff are multiples of 32
        raise ValueError("quantized rows must be multiples of 32")
    plan = _tensor_plan(s)
    tmp = path + ".part"
    w = gguf.GGUFWriter(tmp, LLAMA)
    a = LLAMA
    w.add_string("general.name", f"{NAME_PREFIX} {s.params / 1e9:.2f}B {wtype} (random weights, vocabulary of "
                                 f"{os.path.basename(resolve_model(vocab_from))})")
    for k, v in {f"{a}.context_length": n_ctx_train, f"{a}.embedding_length": s.n_embd,
                 f"{a}.block_count": s.n_layer, f"{a}.feed_forward_length": s.n_ff,
                 f"{a}.rope.dimension_count": s.head_dim, f"{a}.attention.head_count": s.n_head,
                 f"{a}.attention.head_count_kv": s.n_head_kv, f"{a}.vocab_size": n_vocab}.items():
        w.add_uint32(k, v)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    copy_fields(w, vocab)
    for name, shape, _ in plan:
        dtype = np.float16 if len(shape) == 2 and wtype == "f16" else np.float32
        w.add_tensor_info(name, shape, np.dtype(dtype), _nbytes(shape, wtype), raw_dtype=_qtype(wtype, len(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(_nbytes(shape, wtype) for _, shape, _ in plan)
    done, t0, last = 0, time.perf_counter(), -1.0
    for i, (name, shape, scale) in enumerate(plan):
        arr = _encode(_weights(rng, shape, scale), wtype)
        w.write_tensor_data(arr)
        done += arr.nbytes
        now = time.perf_counter() - t0
        if progress and (now - last >= 5.0 or i == len(plan) - 1):
            last = now
            progress(f"{done / 2**20:,.0f} / {total / 2**20:,.0f} MiB, tensor {i + 1}/{len(plan)}, {now:.0f} s")
    w.close()
    os.replace(tmp, path)
    return s
