"""The draft model of the `draft` speculator: a llama context with one sequence per slot.

`DraftModel` loads the draft GGUF, checks it against the target's vocabulary
with llama.cpp's rules (engine/vocab.py) and picks the mode: same vocabulary
(draft token ids go to the target as they are) or, if allowed, cross-vocab
(drafts go through text). `LlamaDraftBackend` is what the pure-Python
DraftSpeculator drives: batched decodes that return each run's top token and
its probability (and its runner-up's, for draft trees), and KV removal.
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp
import numpy as np

from specray.engine.config import DraftModelConfig, DraftSettings, EngineConfig
from specray.engine.speculators.draft import DraftSpeculator
from specray.engine.speculators.draft_base import DraftParams
from specray.engine.vocab import VocabMismatch, VocabMismatchError, vocab_mismatch

from .backends import Backend
from .context import Context
from .model import Model
from .slot_backend import SlotBackend, top_token_probs, top_two_token_probs


class ModelTextVocab:
    """A model's tokenizer over bytes: pieces with special tokens as text, tokenize without BOS."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def piece(self, token: int) -> bytes:
        return self.model.token_to_piece(token, special=True)

    def tokenize(self, text: bytes) -> np.ndarray:
        n_max = len(text) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.model.vocab, text, len(text), buf, n_max, False, True)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.model.vocab, text, len(text), buf, n_max, False, True)
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32)


@dataclass(frozen=True)
class TargetText:
    """Cross-vocab translator: the target's tokenizer; its BOS carries no text for the draft."""

    target: ModelTextVocab
    skip: frozenset[int]


class LlamaDraftBackend(SlotBackend):
    """DraftBackend over a native Context (not thread-safe; the speculator's caller serialises)."""

    def __init__(self, model: Model, ctx: Context) -> None:
        super().__init__(model, ctx)
        self.vocab = ModelTextVocab(model)
        self.prefix: tuple[int, ...] = (model.bos,) if model.add_bos and model.bos >= 0 else ()
        self.rows = 0

    def decode(self, runs: list[tuple[int, np.ndarray, int]], runner_ups: bool = False) -> tuple[np.ndarray, ...]:
        """DraftBackend.decode: (top, prob), and with `runner_ups` (second, second_prob) after them."""
        pick = top_two_token_probs if runner_ups else top_token_probs
        top = np.zeros(len(runs), dtype=np.int32)
        prob = np.zeros(len(runs), dtype=np.float64)
        second = np.zeros(len(runs) if runner_ups else 0, dtype=np.int32)
        second_prob = np.zeros(len(second), dtype=np.float64)
        b = self.ctx.batch
        b.clear()
        owners: list[int] = []  # run index of each logits row of the batch being filled

        def flush() -> None:
            if b.n_tokens == 0:
                return
            logits = self.ctx.decode(b)
            self.n_decodes += 1
            self.rows += b.n_tokens
            if owners:
                got = pick(logits[: len(owners)])
                top[owners], prob[owners] = got[0], got[1]
                if runner_ups:
                    second[owners], second_prob[owners] = got[2], got[3]
            owners.clear()
            b.clear()

        for ri, (seq_id, toks, pos0) in enumerate(runs):
            off, n = 0, len(toks)
            while off < n:
                room = self.n_batch - b.n_tokens
                if room == 0:
                    flush()
                    room = self.n_batch
                take = min(room, n - off)
                last = off + take == n
                b.add_seq(seq_id, toks[off : off + take], pos0 + off, 1 if last else 0)
                if last:
                    owners.append(ri)
                off += take
        flush()
        return (top, prob, second, second_prob) if runner_ups else (top, prob)

    def measure_decode_costs(self, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16), reps: int = 3,
                             prefix: int = 64) -> dict[int, float]:
        """Seconds per draft decode of n rows (n sequences drafting one token each), median of reps."""
        ids = (np.arange(prefix, dtype=np.int32) * 7 + 100) % 1000 + 10
        b = self.ctx.batch
        return self._measure_step_costs(
            sizes, reps, prefix,
            prime=lambda seqs: self.decode([(s, ids, 0) for s in seqs]), clear=b.clear,
            add_row=lambda s, i, pos: b.add_seq(s, ids[i : i + 1], pos, 1), run=lambda: self.ctx.decode(b))


def draft_n_ctx(cfg: DraftModelConfig, target_n_ctx: int, slots: int, cross_vocab: bool) -> int:
    """Draft context cells: the target's, 1.5x through text (a smaller vocabulary needs more tokens), plus
    room for each slot's draft tokens."""
    if cfg.n_ctx is not None:
        return cfg.n_ctx
    return int(target_n_ctx * (1.5 if cross_vocab else 1.0)) + 16 * slots


class DraftModel:
    """A loaded draft model + context, paired with a target vocabulary."""

    def __init__(self, cfg: DraftModelConfig, target: Model, *, slots: int, target_n_ctx: int,
                 settings: DraftSettings | None = None, calibrate: bool = True) -> None:
        """`settings`: how to load it (EngineConfig.draft_settings: the draft's own options, else the target's);
        None: cfg's options over the engine defaults."""
        if not cfg.model:
            raise ValueError("no draft model configured")
        self.config = cfg
        self.settings = s = settings or EngineConfig(draft=cfg).draft_settings()
        self.model = Model(cfg.model, n_gpu_layers=s.n_gpu_layers, main_gpu=s.main_gpu, split_mode=s.split_mode)
        self.mismatch: VocabMismatch | None = vocab_mismatch(target, self.model)
        if self.mismatch is not None and not cfg.cross_vocab:
            self.model.close()
            raise VocabMismatchError(self.mismatch, target.name, cfg.model)
        self.translator = None
        if self.mismatch is not None:
            skip = frozenset({target.bos}) if target.bos >= 0 else frozenset()
            self.translator = TargetText(ModelTextVocab(target), skip)
        try:
            self.ctx = Context(self.model, n_ctx=draft_n_ctx(cfg, target_n_ctx, slots, self.translator is not None),
                               n_seq_max=slots, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_threads=s.threads,
                               n_threads_batch=s.threads_batch, flash_attn=s.flash_attn, type_k=s.cache_type_k,
                               type_v=s.cache_type_v, kv_unified=True)
        except BaseException:
            self.model.close()
            raise
        self.backend = LlamaDraftBackend(self.model, self.ctx)
        if calibrate:
            self.backend.measure_decode_costs()

    @property
    def mode(self) -> str:
        return "cross_vocab" if self.translator is not None else "same_vocab"

    def speculator(self, params: DraftParams | None = None) -> DraftSpeculator:
        """A `draft` speculator on this model (several may share it: each clears a slot it starts using)."""
        return DraftSpeculator(params, self.backend, self.translator)

    def info(self) -> dict:
        return {
            "model": self.config.model,
            "description": self.model.description,
            "mode": self.mode,
            "mismatch": None if self.mismatch is None else f"{self.mismatch.rule}: {self.mismatch.detail}",
            "n_ctx": self.ctx.n_ctx,
            "settings": self.effective_settings(),
            "decode_cost_ms": {k: v * 1000 for k, v in self.backend.decode_costs().items()},
        }

    def effective_settings(self) -> dict:
        """The draft model's load and context settings (/v1/stats): threads and batch sizes read back from the
        llama context (llama.cpp may clamp them), cache types and flash attention as the context was made with
        them (llama.cpp has no getter; it refuses a context it cannot make so), layers and GPU as loaded."""
        c, m = self.ctx, self.model
        return {"n_ctx": c.n_ctx, "threads": int(llama_cpp.llama_n_threads(c.ptr)), "threads_batch": c.n_threads_batch,
                "n_batch": int(llama_cpp.llama_n_batch(c.ptr)), "n_ubatch": c.n_ubatch, "n_gpu_layers": m.n_gpu_layers,
                "main_gpu": m.gpu_split["main_gpu"], "split_mode": m.gpu_split["split_mode"],
                "cache_type_k": c.type_k, "cache_type_v": c.type_v, "flash_attn": c.flash_attn}

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def open_model(cfg: EngineConfig, target_vocab: Model, *, target_n_ctx: int, target_model=None,
               owned=None) -> DraftModel:
    return DraftModel(cfg.draft, target_vocab, slots=cfg.slots, target_n_ctx=target_n_ctx,
                      settings=cfg.draft_settings(), calibrate=cfg.calibrate)


BACKEND = Backend(open_model)
