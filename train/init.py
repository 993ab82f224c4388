"""A head that starts from the target's own weights: a small CPU budget goes much further from there.

- token embeddings: the target's (SmolLM2 ties them to its LM head), kept frozen;
- LM head: the target's output rows (the tied embedding) of the draft vocabulary, so a row h that points
  where the target's final state would point already names the right token, and the rows of tokens the
  training answers rarely use still mean something;
- output norm: the target's, scaled by OUTPUT_NORM_SCALE, so the first logits are soft (near-uniform): with
  the target's full scale a random decoder makes confident wrong guesses;
- fc and the decoder layer: random (a copy of the target's last block, its weights on both halves of the
  [embedding, row] input, starts with confident wrong guesses too and learns slower).
"""

from __future__ import annotations

import numpy as np
import torch

from .head import Dims, Eagle3Module


OUTPUT_NORM_SCALE = 0.2


class TargetWeights:
    """Float32 views of a llama-architecture target GGUF's tensors (dequantized on demand)."""

    def __init__(self, path: str) -> None:
        import gguf

        self.reader = gguf.GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        f = self.reader.fields
        self.arch = str(f["general.architecture"].contents())
        self.meta = {k: f[k].contents() for k in f if k.startswith(self.arch + ".")}

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        # shape in numpy order: [n_out, n_in] for a matrix (ggml {n_in, n_out})
        return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            [int(x) for x in reversed(t.shape)])

    def raw(self, name: str):
        """(bytes as uint8 [rows, row bytes], ggml type) of a tensor, to copy it into another GGUF unchanged."""
        t = self.tensors[name]
        return np.asarray(t.data), t.tensor_type

    def key(self, suffix: str, default=None):
        return self.meta.get(f"{self.arch}.{suffix}", default)

    def lm_head_name(self) -> str:
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"


def dims_for(tw: TargetWeights, shape, n_vocab: int, draft_vocab: int) -> Dims:
    """The head's Dims: `shape` (config.HeadShape) with zeros filled from the target."""
    n_layer = int(tw.key("block_count"))
    layers = tuple(shape.target_layers or (2, n_layer // 2, n_layer - 3))
    if len(layers) != 3 or any(not 0 <= x < n_layer for x in layers):
        raise ValueError(f"--target-layers: three layer ids in [0, {n_layer}), got {layers}")
    width = int(tw.key("embedding_length"))
    n_embd = shape.n_embd or width
    n_head = shape.n_head or int(tw.key("attention.head_count"))
    n_head_kv = shape.n_head_kv or int(tw.key("attention.head_count_kv"))
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"head width {n_embd} must divide by its heads {n_head}, and those by KV heads {n_head_kv}")
    return Dims(n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                n_ff=shape.n_ff or int(tw.key("feed_forward_length")), target_width=width, n_vocab=n_vocab,
                draft_vocab=draft_vocab, target_layers=layers,  # type: ignore[arg-type]
                rope_base=float(tw.key("rope.freq_base", 10000.0)),
                eps=float(tw.key("attention.layer_norm_rms_epsilon", 1e-5)),
                n_ctx_train=int(tw.key("context_length", 8192)))


def build_head(tw: TargetWeights, d: Dims, d2t: np.ndarray | None, init: str, seed: int) -> Eagle3Module:
    """A head of shape `d` on the target's token embeddings; `init` 'target': LM head and output norm from the
    target (module docstring), 'random': random weights."""
    torch.manual_seed(seed)
    embed = torch.from_numpy(tw.get("token_embd.weight"))
    if embed.shape[1] != d.n_embd:
        raise ValueError(f"the head's width {d.n_embd} must be the target's {embed.shape[1]} (its token embeddings)")
    m = Eagle3Module(d, embed, None if d2t is None else torch.from_numpy(d2t.astype(np.int64)))
    if init == "random":
        return m
    with torch.no_grad():
        rows = torch.from_numpy(tw.get(tw.lm_head_name()))
        m.lm_head.copy_(rows[m.d2t])
        m.output_norm.copy_(torch.from_numpy(tw.get("output_norm.weight")) * OUTPUT_NORM_SCALE)
    return m
