"""Tiny synthetic GGUFs for tests: hidden-state speculators (no MTP / EAGLE-3 weights exist offline) and
recurrent targets (what a rejected draft does to a state that cannot simply be truncated).

Every writer borrows a real model's vocabulary (SmolLM2's by default, so
prompts, chat templates and detokenisation work) and fills every weight with
seeded random numbers (same seed, same file):

- `write_mtp_target`: a GLM-4.5-style (`glm4moe`) target with `n_layer` trunk
  blocks and one NextN (MTP) block, an architecture the vendored llama.cpp
  runs on CPU with a DECODER_MTP graph and a plain attention KV cache.
  `mtp_head="copy_last"` makes the NextN block a copy of the last trunk block
  that ignores the hidden row (eh_proj = [I, 0]); with one trunk block and
  unit-RMS token embeddings the head then computes what the target computes,
  so its drafts are accepted (the forced-acceptance test); `copy_noise`
  perturbs the copy so that some are rejected. `"random"` gives a head whose
  drafts are almost never accepted.
- `write_eagle3_draft`: an EAGLE-3 draft (`eagle3` architecture: fc fusion of
  three target layers, one decoder layer, its own token embeddings and LM
  head) for a target such as SmolLM2-135M, reading three of its layer inputs.
- `write_dflash_draft`: a DFlash block-diffusion draft (`dflash` architecture:
  fc fusion of the target layers it reads, injected into its own KV cache;
  `n_layer` non-causal decoder blocks over [last token, <mask> x (block-1)];
  its own token embeddings and a reduced-vocabulary LM head over the
  target's first `draft_vocab` token ids, mapped back by `d2t`) for a target such as
  SmolLM2-135M. Its width is the target's (llama.cpp sizes the fc input as
  n_target_layers x the draft's n_embd). `selector_top_k > 0` writes a
  DFlash2 draft instead: per-block-position convolutions and the selector
  whose top-k lattice llama.cpp returns in place of the block's logits.
- `write_recurrent_target`: a pure Mamba-2 (`mamba2`) target, recurrent only.
  The vendored llama.cpp keeps no n_rs_seq snapshots for this architecture
  (it clamps the request to 0), so a partial seq_rm is refused: the model for
  the checkpoint-and-replay path (native/checkpoints.py).
- `write_hybrid_target`: an LFM2 (`lfm2`) hybrid, short-convolution blocks
  mixed with attention blocks (head_count_kv 0 marks a convolution). llama.cpp
  snapshots its convolution states (n_rs_seq), so the last few tokens of a
  single decode can be dropped with seq_rm: the model for that path.

The two recurrent targets would babble tokens that never repeat with a random
LM head, which n-gram speculators never predict. Their heads send a hidden
state near token x's embedding to x's successor on short random cycles
(`loop_len`), and each block's output is scaled down (`branch_scale`) so the
last token dominates the hidden state: greedy decoding wanders a few tokens,
then loops, which an n-gram speculator predicts only once the loop has begun.

Each takes a fraction of a second; tests write them into a temp dir. The
command line writes one: `python -m specray.native.synthetic_gguf --help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .gguf_meta import read_metadata
from .models import resolve_model

GLM4MOE = "glm4moe"
EAGLE3 = "eagle3"
DFLASH = "dflash"
MAMBA2 = "mamba2"
LFM2 = "lfm2"


@dataclass(frozen=True)
class MtpTargetSpec:
    """Shape of a synthetic glm4moe target with one NextN block."""

    n_layer: int = 1  # trunk blocks (the NextN block comes after them)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_expert: int = 2
    n_expert_used: int = 1
    n_ff_exp: int = 32
    n_ctx_train: int = 8192
    mtp_head: Literal["random", "copy_last"] = "random"
    copy_noise: float = 0.0  # copy_last: relative noise on the copied block, so some drafts are rejected
    seed: int = 0


@dataclass(frozen=True)
class Eagle3DraftSpec:
    """Shape of a synthetic EAGLE-3 draft; `target_layers` None = llama.cpp's default [2, n/2, n-3]."""

    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    target_layers: tuple[int, int, int] | None = None
    seed: int = 0


@dataclass(frozen=True)
class DFlashDraftSpec:
    """Shape of a synthetic DFlash draft; `target_layers` None = (1, n/2, n-3) of the target's n layers.

    n_embd is the target's (not a field). `selector_top_k` > 0: DFlash2 (llama.cpp needs n_embd >= k (k + 1)
    and n_embd divisible by `conv_group_size`)."""

    n_layer: int = 1
    n_head: int = 9
    n_head_kv: int = 3
    n_ff: int = 128
    block_size: int = 8  # dflash.block_size: the anchor + up to block_size - 1 drafted tokens per decode
    target_layers: tuple[int, ...] | None = None
    mask_token: int = 16  # tokenizer.ggml.mask_token_id; SmolLM2's id 16 is the unused control <empty_output>
    # LM head rows (target ids 0..draft_vocab-1 through d2t): a head tied to the embeddings would predict each
    # input token again, so every draft would be the mask token; a full-vocabulary head costs 56 MB more
    draft_vocab: int = 4096
    selector_top_k: int = 0  # DFlash2 selector candidates per block position; 0: a plain DFlash draft
    selector_rank: int = 16
    conv_kernel_size: int = 3
    conv_group_size: int = 64
    seed: int = 0


@dataclass(frozen=True)
class RecurrentTargetSpec:
    """Shape of a synthetic pure Mamba-2 (`mamba2`) target: `n_layer` SSM mixer blocks, no attention, no FFN."""

    n_layer: int = 2
    n_embd: int = 64
    d_inner: int = 128  # 2 * n_embd, Mamba-2's expand factor
    d_state: int = 16
    n_head: int = 8  # SSM heads (llama.cpp's ssm.time_step_rank); head_dim = d_inner / n_head
    n_group: int = 1
    d_conv: int = 4
    n_ctx_train: int = 8192
    loop_len: int = 4  # the LM head's successor cycles (see _Init.loop_head); 1: repeat the last token
    loop_tie: float = 0.8  # share of an LM-head row that is its predecessor's embedding; 0: a random head
    branch_scale: float = 0.7  # on each mixer's output: smaller, the last token dominates and loops start sooner
    seed: int = 0


@dataclass(frozen=True)
class HybridTargetSpec:
    """Shape of a synthetic LFM2 (`lfm2`) hybrid: short-convolution blocks, attention at `attn_layers`."""

    n_layer: int = 4
    attn_layers: tuple[int, ...] = (1, 3)  # the other blocks are short convolutions (head_count_kv 0)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    l_cache: int = 3  # short-convolution kernel: the state is the last l_cache - 1 inputs
    n_ctx_train: int = 8192
    loop_len: int = 4  # as RecurrentTargetSpec
    loop_tie: float = 0.8
    branch_scale: float = 0.5  # on each conv, attention and FFN output (more branches than the Mamba-2 target)
    seed: int = 0


def vocab_fields(model: str) -> list[tuple[str, int, object, int | None]]:
    """The tokenizer.* metadata (vocabulary, merges, special ids, chat template) of a GGUF."""
    return [(k, *v) for k, v in read_metadata(model).items() if k.startswith("tokenizer.")]


def _meta(model: str, key: str):
    return read_metadata(model)[key][1]


def copy_fields(writer, fields) -> None:
    """Add `fields` (as vocab_fields returns them: key, value type, value, array sub-type) to a GGUFWriter."""
    import gguf

    for key, vtype, value, sub in fields:
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))


def write_gguf(path: str, arch: str, keys: dict, vocab, tensors: dict[str, np.ndarray | tuple]) -> str:
    """Write a GGUF at `path` (through path + ".part", then renamed) and return path: `keys` by their Python
    type (bool, float32, uint32, string, array), the tokenizer fields `vocab` (vocab_fields), then `tensors`
    (an array, or (bytes, ggml type) for a quantized tensor copied as it is)."""
    import gguf

    tmp = path + ".part"
    w = gguf.GGUFWriter(tmp, arch)
    for k, v in keys.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))
        else:  # pragma: no cover - a writer bug
            raise TypeError(f"{k}: {type(v)}")
    copy_fields(w, vocab)
    for name, arr in tensors.items():
        if isinstance(arr, tuple):  # (bytes [rows, row bytes], ggml type): a quantized tensor copied as it is
            w.add_tensor(name, arr[0], raw_dtype=arr[1])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def _cycle_predecessors(perm: np.ndarray, loop_len: int) -> np.ndarray:
    """pred[t] for cycles made of consecutive runs of `loop_len` tokens of `perm` (the last run may be shorter).

    >>> _cycle_predecessors(np.array([3, 0, 2, 1, 4]), 2).tolist()  # cycles 3->0->3, 2->1->2, 4->4
    [3, 2, 1, 0, 4]
    """
    pred = np.empty(len(perm), dtype=np.int64)
    for i in range(0, len(perm), loop_len):
        cyc = perm[i : i + loop_len]
        pred[np.roll(cyc, -1)] = cyc  # cyc[k] precedes cyc[k + 1]
    return pred


class _Init:
    """Seeded random weights: unit-RMS embedding rows, 1/sqrt(fan_in) projections, unit norms."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def embd(self, n_vocab: int, n_embd: int) -> np.ndarray:
        e = self.rng.standard_normal((n_vocab, n_embd), dtype=np.float32)
        return e / np.sqrt((e * e).mean(axis=1, keepdims=True))  # RMS 1: RMSNorm leaves them (almost) unchanged

    def mat(self, n_out: int, n_in: int) -> np.ndarray:
        # numpy [n_out, n_in] = ggml {n_in, n_out}: y = W x
        return (self.rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)

    def loop_head(self, embd: np.ndarray, loop_len: int, tie: float) -> np.ndarray:
        """An LM head that, given a hidden state close to token x's embedding, ranks x's successor first on
        random cycles of `loop_len` tokens: row t is `tie` of t's predecessor's embedding, the rest noise. The
        recurrent state pulls the hidden state away from the last token's row, so greedy decoding wanders a
        few tokens and then falls into one of the cycles: text an n-gram speculator partly predicts."""
        n_vocab, n_embd = embd.shape
        pred = _cycle_predecessors(self.rng.permutation(n_vocab), loop_len)
        noise = self.embd(n_vocab, n_embd)
        return tie * embd[pred] + np.float32(np.sqrt(max(0.0, 1.0 - tie * tie))) * noise

    def experts(self, n_expert: int, n_out: int, n_in: int) -> np.ndarray:
        return np.stack([self.mat(n_out, n_in) for _ in range(n_expert)])

    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)


def _glm4moe_block(init: _Init, s: MtpTargetSpec, head_dim: int) -> dict[str, np.ndarray]:
    """One glm4moe block (attention with Q/K/V bias, post-attention norm, MoE FFN + one shared expert)."""
    q, kv = s.n_head * head_dim, s.n_head_kv * head_dim
    return {
        "attn_norm.weight": init.ones(s.n_embd),
        "attn_q.weight": init.mat(q, s.n_embd),
        "attn_k.weight": init.mat(kv, s.n_embd),
        "attn_v.weight": init.mat(kv, s.n_embd),
        "attn_q.bias": np.zeros(q, dtype=np.float32),
        "attn_k.bias": np.zeros(kv, dtype=np.float32),
        "attn_v.bias": np.zeros(kv, dtype=np.float32),
        "attn_output.weight": init.mat(s.n_embd, q),
        "post_attention_norm.weight": init.ones(s.n_embd),
        "ffn_gate_inp.weight": init.mat(s.n_expert, s.n_embd),
        "exp_probs_b.bias": np.zeros(s.n_expert, dtype=np.float32),
        "ffn_gate_exps.weight": init.experts(s.n_expert, s.n_ff_exp, s.n_embd),
        "ffn_up_exps.weight": init.experts(s.n_expert, s.n_ff_exp, s.n_embd),
        "ffn_down_exps.weight": init.experts(s.n_expert, s.n_embd, s.n_ff_exp),
        "ffn_gate_shexp.weight": init.mat(s.n_ff_exp, s.n_embd),
        "ffn_up_shexp.weight": init.mat(s.n_ff_exp, s.n_embd),
        "ffn_down_shexp.weight": init.mat(s.n_embd, s.n_ff_exp),
    }


def write_mtp_target(path: str, spec: MtpTargetSpec = MtpTargetSpec(), vocab_from: str = "smollm2-135m") -> str:
    """Write a glm4moe target with `spec.n_layer` trunk blocks + 1 NextN block to `path`; returns path."""
    s = spec
    if s.n_embd % s.n_head or s.n_head % s.n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    if s.mtp_head == "copy_last" and s.n_layer != 1:
        raise ValueError("a copied head reproduces the target only with one trunk block (n_layer=1)")
    n_vocab = len(_meta(vocab_from, "tokenizer.ggml.tokens"))
    head_dim = s.n_embd // s.n_head
    init = _Init(s.seed)
    tensors: dict[str, np.ndarray] = {
        # f16: half the file. An LM head of its own: tied to the embeddings, a random one-block model
        # predicts the token it was fed, over and over
        "token_embd.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output_norm.weight": init.ones(s.n_embd),
    }
    blocks = [_glm4moe_block(init, s, head_dim) for _ in range(s.n_layer)]
    if s.mtp_head == "copy_last":
        nextn = {k: v.copy() for k, v in blocks[-1].items()}
        if s.copy_noise:
            for k, v in nextn.items():
                if v.ndim >= 2:
                    v += (s.copy_noise * np.abs(v).mean() * init.rng.standard_normal(v.shape)).astype(np.float32)
        eh = np.zeros((s.n_embd, 2 * s.n_embd), dtype=np.float32)
        eh[:, : s.n_embd] = np.eye(s.n_embd, dtype=np.float32)  # [enorm(e), hnorm(h)] -> e: the row is ignored
    else:
        nextn = _glm4moe_block(init, s, head_dim)
        eh = init.mat(s.n_embd, 2 * s.n_embd)
    nextn |= {"nextn.eh_proj.weight": eh, "nextn.enorm.weight": init.ones(s.n_embd),
              "nextn.hnorm.weight": init.ones(s.n_embd)}
    for i, blk in enumerate([*blocks, nextn]):
        for k, v in blk.items():
            tensors[f"blk.{i}.{k}"] = v
    a = GLM4MOE
    keys = {
        "general.name": f"specray synthetic glm4moe {s.n_layer}+1 nextn ({s.mtp_head} head)",
        f"{a}.context_length": s.n_ctx_train,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": s.n_layer + 1,
        f"{a}.nextn_predict_layers": 1,
        f"{a}.feed_forward_length": s.n_ff_exp,
        f"{a}.expert_feed_forward_length": s.n_ff_exp,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.expert_count": s.n_expert,
        f"{a}.expert_used_count": s.n_expert_used,
        f"{a}.expert_shared_count": 1,
        f"{a}.leading_dense_block_count": 0,
        f"{a}.expert_weights_scale": 1.0,
        f"{a}.expert_weights_norm": True,
        f"{a}.expert_gating_func": 2,  # sigmoid, as GLM-4.5
        f"{a}.vocab_size": n_vocab,
    }
    return write_gguf(path, a, keys, vocab_fields(vocab_from), tensors)


def head_keys(a: str, target: str, arch: str, n_embd: int, n_layer: int, s, head_dim: int, layers,
               n_vocab: int) -> dict:
    """The metadata an EAGLE-3 or DFlash draft shares: its shape, rope, and the target layers it reads."""
    return {
        f"{a}.context_length": int(_meta(target, f"{arch}.context_length")),
        f"{a}.embedding_length": n_embd,
        f"{a}.block_count": n_layer,
        f"{a}.feed_forward_length": s.n_ff,
        f"{a}.attention.head_count": s.n_head,
        f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.target_layers": [int(x) for x in layers],
        f"{a}.vocab_size": n_vocab,
    }


def write_eagle3_draft(path: str, spec: Eagle3DraftSpec = Eagle3DraftSpec(), target: str = "smollm2-135m") -> str:
    """Write an EAGLE-3 draft for `target` (alias or path; its vocabulary is copied) to `path`."""
    s = spec
    arch = _meta(target, "general.architecture")
    n_layer_tgt = int(_meta(target, f"{arch}.block_count"))
    n_embd_tgt = int(_meta(target, f"{arch}.embedding_length"))
    n_vocab = len(_meta(target, "tokenizer.ggml.tokens"))
    layers = s.target_layers or (2, n_layer_tgt // 2, n_layer_tgt - 3)
    if len(layers) != 3 or any(not 0 <= x < n_layer_tgt for x in layers):
        raise ValueError(f"target_layers must be 3 layer ids in [0, {n_layer_tgt}), got {layers}")
    head_dim = s.n_embd // s.n_head
    init = _Init(s.seed)
    q, kv = s.n_head * head_dim, s.n_head_kv * head_dim
    tensors = {
        "token_embd.weight": init.embd(n_vocab, s.n_embd).astype(np.float16),
        "output.weight": (init.mat(n_vocab, s.n_embd) * np.float32(np.sqrt(s.n_embd))).astype(np.float16),
        "output_norm.weight": init.ones(s.n_embd),
        "fc.weight": init.mat(s.n_embd, 3 * n_embd_tgt),
        "blk.0.attn_norm.weight": init.ones(s.n_embd),
        "blk.0.attn_norm_2.weight": init.ones(s.n_embd),
        "blk.0.attn_q.weight": init.mat(q, 2 * s.n_embd),
        "blk.0.attn_k.weight": init.mat(kv, 2 * s.n_embd),
        "blk.0.attn_v.weight": init.mat(kv, 2 * s.n_embd),
        "blk.0.attn_output.weight": init.mat(s.n_embd, q),
        "blk.0.ffn_norm.weight": init.ones(s.n_embd),
        "blk.0.ffn_gate.weight": init.mat(s.n_ff, s.n_embd),
        "blk.0.ffn_up.weight": init.mat(s.n_ff, s.n_embd),
        "blk.0.ffn_down.weight": init.mat(s.n_embd, s.n_ff),
    }
    a = EAGLE3
    keys = {
        "general.name": f"specray synthetic eagle3 draft for {os.path.basename(resolve_model(target))}",
        **head_keys(a, target, arch, s.n_embd, 1, s, head_dim, layers, n_vocab),
        f"{a}.target_hidden_size": n_embd_tgt,
    }
    return write_gguf(path, a, keys, vocab_fields(target), tensors)


def write_dflash_draft(path: str, spec: DFlashDraftSpec = DFlashDraftSpec(), target: str = "smollm2-135m") -> str:
    """Write a DFlash (or, with selector_top_k > 0, DFlash2) draft for `target` (alias or path; its vocabulary
    is copied, with `spec.mask_token` as the mask token) to `path`."""
    s = spec
    arch = _meta(target, "general.architecture")
    n_layer_tgt = int(_meta(target, f"{arch}.block_count"))
    n_embd = int(_meta(target, f"{arch}.embedding_length"))
    n_vocab = len(_meta(target, "tokenizer.ggml.tokens"))
    layers = s.target_layers or (1, n_layer_tgt // 2, n_layer_tgt - 3)
    if not layers or any(not 0 <= x < n_layer_tgt for x in layers):
        raise ValueError(f"target_layers must be layer ids in [0, {n_layer_tgt}), got {layers}")
    if (n_embd % s.n_head or s.n_head % s.n_head_kv or s.block_size < 2 or not 0 <= s.mask_token < n_vocab
            or not 0 < s.draft_vocab <= n_vocab):
        raise ValueError("n_embd must divide by n_head, n_head by n_head_kv; block_size >= 2; mask_token a token "
                         "id; draft_vocab in [1, n_vocab]")
    k = s.selector_top_k
    if k and (n_embd % s.conv_group_size or n_embd < k * (k + 1)):
        raise ValueError(f"DFlash2: n_embd {n_embd} must divide by conv_group_size and be >= k (k + 1)")
    head_dim = n_embd // s.n_head
    init = _Init(s.seed)
    q, kv = s.n_head * head_dim, s.n_head_kv * head_dim
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": init.embd(n_vocab, n_embd).astype(np.float16),
        "output.weight": (init.mat(s.draft_vocab, n_embd) * np.float32(np.sqrt(n_embd))).astype(np.float16),
        "d2t": np.arange(s.draft_vocab, dtype=np.int64),  # draft row i -> target token i (llama.cpp: absolute ids)
        "output_norm.weight": init.ones(n_embd),
        "fc.weight": init.mat(n_embd, len(layers) * n_embd),
        "enc.output_norm.weight": init.ones(n_embd),
    }
    groups = n_embd // s.conv_group_size if k else 0
    for i in range(s.n_layer):
        blk = {
            "attn_norm.weight": init.ones(n_embd),
            "attn_q.weight": init.mat(q, n_embd),
            "attn_k.weight": init.mat(kv, n_embd),
            "attn_v.weight": init.mat(kv, n_embd),
            "attn_output.weight": init.mat(n_embd, q),
            "attn_q_norm.weight": init.ones(head_dim),
            "attn_k_norm.weight": init.ones(head_dim),
            "ffn_norm.weight": init.ones(n_embd),
            "ffn_gate.weight": init.mat(s.n_ff, n_embd),
            "ffn_up.weight": init.mat(s.n_ff, n_embd),
            "ffn_down.weight": init.mat(n_embd, s.n_ff),
        }
        if k:  # ggml {n_embd, kernel, 2} = numpy [2, kernel, n_embd]; projections to 2 x kernel x groups
            for side in ("attn", "ffn"):
                blk[f"{side}_conv_base"] = (0.1 * init.rng.standard_normal((2, s.conv_kernel_size, n_embd))
                                            ).astype(np.float32)
                blk[f"{side}_conv_proj.weight"] = init.mat(2 * s.conv_kernel_size * groups, n_embd) * np.float32(0.1)
        for name, v in blk.items():
            tensors[f"blk.{i}.{name}"] = v
    if k:
        tensors |= {"selector_predecessor.weight": init.mat(n_vocab, s.selector_rank),
                    "selector_successor.weight": init.mat(n_vocab, s.selector_rank),
                    "selector_hidden.weight": init.mat(s.selector_rank, n_embd)}
    a = DFLASH
    keys = {
        "general.name": f"specray synthetic {'dflash2' if k else 'dflash'} draft for "
                        f"{os.path.basename(resolve_model(target))}",
        **head_keys(a, target, arch, n_embd, s.n_layer, s, head_dim, layers, n_vocab),
        f"{a}.block_size": s.block_size,
    }
    if k:
        keys |= {f"{a}.selector_top_k": k, f"{a}.selector_rank": s.selector_rank,
                 f"{a}.conv_kernel_size": s.conv_kernel_size, f"{a}.conv_group_size": s.conv_group_size}
    vocab = [f for f in vocab_fields(target) if f[0] != "tokenizer.ggml.mask_token_id"]
    vocab.append(("tokenizer.ggml.mask_token_id", 4, int(s.mask_token), None))  # 4: uint32
    return write_gguf(path, a, keys, vocab, tensors)


def write_recurrent_target(path: str, spec: RecurrentTargetSpec = RecurrentTargetSpec(),
                           vocab_from: str = "smollm2-135m") -> str:
    """Write a pure Mamba-2 target (`mamba2`) with `vocab_from`'s vocabulary to `path`; returns path."""
    s = spec
    if s.d_inner % s.n_head or s.d_inner % s.n_group or s.n_head % s.n_group:
        raise ValueError("d_inner must divide by n_head and n_group, and n_head by n_group")
    if s.d_conv < 2:
        raise ValueError("d_conv must be at least 2 (the conv state keeps d_conv - 1 inputs)")
    _check_loop(s.loop_len, s.loop_tie)
    n_vocab = len(_meta(vocab_from, "tokenizer.ggml.tokens"))
    init = _Init(s.seed)
    conv_dim = s.d_inner + 2 * s.n_group * s.d_state  # x, B, C go through the convolution
    d_in_proj = s.d_inner + conv_dim + s.n_head  # z, xBC, dt
    embd = init.embd(n_vocab, s.n_embd)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": embd.astype(np.float16),
        "output.weight": init.loop_head(embd, s.loop_len, s.loop_tie).astype(np.float16),
        "output_norm.weight": init.ones(s.n_embd),
    }
    for i in range(s.n_layer):
        blk = {
            "attn_norm.weight": init.ones(s.n_embd),
            "ssm_in.weight": init.mat(d_in_proj, s.n_embd),
            "ssm_conv1d.weight": init.mat(conv_dim, s.d_conv),
            "ssm_conv1d.bias": np.zeros(conv_dim, dtype=np.float32),
            **_mamba2_ssm_params(init, s.n_head),
            "ssm_norm.weight": np.ones((s.n_group, s.d_inner // s.n_group), dtype=np.float32),
            "ssm_out.weight": init.mat(s.n_embd, s.d_inner) * np.float32(s.branch_scale),
        }
        for k, v in blk.items():
            tensors[f"blk.{i}.{k}"] = v
    a = MAMBA2
    keys = {
        "general.name": f"specray synthetic mamba2 {s.n_layer} layers",
        f"{a}.context_length": s.n_ctx_train,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": s.n_layer,
        f"{a}.ssm.conv_kernel": s.d_conv,
        f"{a}.ssm.inner_size": s.d_inner,
        f"{a}.ssm.state_size": s.d_state,
        f"{a}.ssm.time_step_rank": s.n_head,
        f"{a}.ssm.group_count": s.n_group,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.vocab_size": n_vocab,
    }
    return write_gguf(path, a, keys, vocab_fields(vocab_from), tensors)


def _check_loop(loop_len: int, loop_tie: float) -> None:
    if loop_len < 1 or not 0.0 <= loop_tie <= 1.0:
        raise ValueError(f"loop_len must be >= 1 and loop_tie in [0, 1], got {loop_len}, {loop_tie}")


def _mamba2_ssm_params(init: _Init, n_head: int) -> dict[str, np.ndarray]:
    """Per-head A (decay), dt bias and D (skip) as Mamba-2 initialises them: A in [-16, -1], dt in [1e-3, 0.1]."""
    a = -init.rng.uniform(1.0, 16.0, n_head)  # llama.cpp stores A = -exp(A_log)
    dt = np.exp(init.rng.uniform(np.log(1e-3), np.log(0.1), n_head))
    dt_bias = dt + np.log(-np.expm1(-dt))  # softplus(dt_bias) = dt
    return {
        "ssm_dt.bias": dt_bias.astype(np.float32),
        "ssm_a": a.astype(np.float32).reshape(n_head, 1),  # ggml {1, n_head}
        "ssm_d": np.ones((n_head, 1), dtype=np.float32),
    }


def write_hybrid_target(path: str, spec: HybridTargetSpec = HybridTargetSpec(),
                        vocab_from: str = "smollm2-135m") -> str:
    """Write an LFM2 hybrid (`lfm2`) with `vocab_from`'s vocabulary to `path`; returns path."""
    s = spec
    if s.n_embd % s.n_head or s.n_head % s.n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    attn = sorted(set(s.attn_layers))
    if not attn or len(attn) == s.n_layer or any(not 0 <= i < s.n_layer for i in attn):
        raise ValueError(f"attn_layers must name some, not all, of the layers [0, {s.n_layer}), got {s.attn_layers}")
    if s.l_cache < 2:
        raise ValueError("l_cache must be at least 2 (the conv state keeps l_cache - 1 inputs)")
    _check_loop(s.loop_len, s.loop_tie)
    n_vocab = len(_meta(vocab_from, "tokenizer.ggml.tokens"))
    head_dim = s.n_embd // s.n_head
    kv = s.n_head_kv * head_dim
    init = _Init(s.seed)
    out_scale = np.float32(s.branch_scale)
    embd = init.embd(n_vocab, s.n_embd)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": embd.astype(np.float16),
        "output.weight": init.loop_head(embd, s.loop_len, s.loop_tie).astype(np.float16),
        "token_embd_norm.weight": init.ones(s.n_embd),  # LFM2's final norm, under this (historical) name
    }
    for i in range(s.n_layer):
        blk = {"attn_norm.weight": init.ones(s.n_embd)}
        if i in attn:
            blk |= {
                "attn_q_norm.weight": init.ones(head_dim),
                "attn_k_norm.weight": init.ones(head_dim),
                "attn_q.weight": init.mat(s.n_embd, s.n_embd),
                "attn_k.weight": init.mat(kv, s.n_embd),
                "attn_v.weight": init.mat(kv, s.n_embd),
                "attn_output.weight": init.mat(s.n_embd, s.n_embd) * out_scale,
            }
        else:
            blk |= {
                "shortconv.conv.weight": init.mat(s.n_embd, s.l_cache),
                "shortconv.in_proj.weight": init.mat(3 * s.n_embd, s.n_embd),
                "shortconv.out_proj.weight": init.mat(s.n_embd, s.n_embd) * out_scale,
            }
        blk |= {
            "ffn_norm.weight": init.ones(s.n_embd),
            "ffn_gate.weight": init.mat(s.n_ff, s.n_embd),
            "ffn_up.weight": init.mat(s.n_ff, s.n_embd),
            "ffn_down.weight": init.mat(s.n_embd, s.n_ff) * out_scale,
        }
        for k, v in blk.items():
            tensors[f"blk.{i}.{k}"] = v
    a = LFM2
    keys = {
        "general.name": f"specray synthetic lfm2 {s.n_layer} layers, attention at {attn}",
        f"{a}.context_length": s.n_ctx_train,
        f"{a}.embedding_length": s.n_embd,
        f"{a}.block_count": s.n_layer,
        f"{a}.feed_forward_length": s.n_ff,
        f"{a}.attention.head_count": s.n_head,
        # 0 KV heads marks a short-convolution layer (llama.cpp's is_recr)
        f"{a}.attention.head_count_kv": [s.n_head_kv if i in attn else 0 for i in range(s.n_layer)],
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.shortconv.l_cache": s.l_cache,
        f"{a}.vocab_size": n_vocab,
    }
    return write_gguf(path, a, keys, vocab_fields(vocab_from), tensors)


def cache_path(name: str) -> str:
    """A path under specray's model cache (~/.cache/specray/models) for a generated file."""
    from .draft_truncate import cache_dir

    return os.path.join(cache_dir(), name)


#: --kind -> (writer, spec class); a writer takes (path, spec, vocabulary source)
_KINDS = {
    "mtp": (write_mtp_target, MtpTargetSpec),
    "eagle3": (write_eagle3_draft, Eagle3DraftSpec),
    "dflash": (write_dflash_draft, DFlashDraftSpec),
    "dflash2": (lambda path, spec, target: write_dflash_draft(path, replace(spec, selector_top_k=4), target),
                DFlashDraftSpec),
    "recurrent": (write_recurrent_target, RecurrentTargetSpec),
    "hybrid": (write_hybrid_target, HybridTargetSpec),
}


def main(argv: list[str] | None = None) -> int:
    """`python -m specray.native.synthetic_gguf --kind KIND --out PATH.gguf [--seed N]`: print the path written."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m specray.native.synthetic_gguf",
        description="Write a tiny random-weight GGUF with a real model's vocabulary, for tests: "
                    "mtp (glm4moe target + NextN head), eagle3 (EAGLE-3 draft for the --vocab-from model), "
                    "dflash / dflash2 (a DFlash block-diffusion draft for it; dflash2 with the top-4 selector), "
                    "recurrent (pure Mamba-2: no partial rollback in llama.cpp), "
                    "hybrid (LFM2: short convolutions + attention, n_rs_seq rollback). "
                    "Same kind and seed, same bytes.",
    )
    ap.add_argument("--kind", required=True, choices=list(_KINDS), help="which model to write")
    ap.add_argument("--out", required=True, metavar="PATH.gguf", help="file to write (replaced if it exists)")
    ap.add_argument("--seed", type=int, default=0, help="weights' random seed (default 0)")
    ap.add_argument("--vocab-from", default="smollm2-135m", metavar="MODEL",
                    help="alias or GGUF path whose vocabulary, tokenizer and chat template are copied; for "
                         "eagle3 and dflash, the target it drafts for (default smollm2-135m)")
    args = ap.parse_args(argv)
    writer, spec = _KINDS[args.kind]
    print(writer(args.out, spec(seed=args.seed), args.vocab_from))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
