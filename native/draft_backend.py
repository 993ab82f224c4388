"""The draft model of the `draft` speculator: a llama context with one sequence per slot.

`DraftModel` loads the draft GGUF, checks it against the target's vocabulary
with llama.cpp's rules (engine/vocab.py) and picks the mode: same vocabulary
(draft token ids go to the target as they are) or, if allowed, cross-vocab
(drafts go through text). `LlamaDraftBackend` is what the pure-Python
DraftSpeculator drives: batched decodes that return each run's top token and
its probability, and KV removal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llama_cpp
import numpy as np

from specray.engine.config import DraftModelConfig
from specray.engine.speculators.draft import DraftSpeculator
from specray.engine.speculators.draft_base import DraftParams
from specray.engine.vocab import VocabMismatch, VocabMismatchError, vocab_mismatch

from .context import Context
from .model import Model


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


def top_token_probs(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Argmax of each row and its softmax probability (over the whole vocabulary)."""
    top = logits.argmax(axis=1)
    m = logits[np.arange(len(top)), top]
    z = np.exp(logits - m[:, None]).sum(axis=1)
    return top.astype(np.int32), (1.0 / z).astype(np.float64)


class LlamaDraftBackend:
    """DraftBackend over a native Context (not thread-safe; the speculator's caller serialises)."""

    def __init__(self, model: Model, ctx: Context) -> None:
        self.model = model
        self.ctx = ctx
        self.n_batch = ctx.n_batch
        self.vocab = ModelTextVocab(model)
        self.prefix: tuple[int, ...] = (model.bos,) if model.add_bos and model.bos >= 0 else ()
        self._costs: dict[int, float] = {}
        self.n_decodes = 0
        self.rows = 0

    def decode(self, runs: list[tuple[int, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
        top = np.zeros(len(runs), dtype=np.int32)
        prob = np.zeros(len(runs), dtype=np.float64)
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
                t, p = top_token_probs(logits[: len(owners)])
                top[owners] = t
                prob[owners] = p
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
        return top, prob

    def seq_rm(self, seq_id: int, p0: int) -> None:
        self.ctx.seq_rm(seq_id, p0, -1)

    def pos_max(self, seq_id: int) -> int:
        return self.ctx.seq_pos_max(seq_id)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def decode_costs(self) -> dict[int, float]:
        return dict(self._costs)

    def measure_decode_costs(self, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16), reps: int = 3,
                             prefix: int = 64, seq_id: int = 0) -> dict[int, float]:
        """Seconds per draft decode of n rows (n sequences drafting one token each), median of reps.

        Every row belongs to its own sequence after a `prefix`-token context, as in a draft step."""
        n_seq = max(1, min(self.ctx.n_seq_max, max(sizes)))
        ids = (np.arange(prefix, dtype=np.int32) * 7 + 100) % 1000 + 10
        seqs = list(range(n_seq))
        for s in seqs:
            self.ctx.clear_seq(s)
        self.decode([(s, ids, 0) for s in seqs])
        out: dict[int, float] = {}
        b = self.ctx.batch
        for n in sizes:
            if n > self.n_batch:
                continue
            times = []
            for _ in range(reps + 1):
                b.clear()
                for j in range(n):
                    # more rows than sequences: the extra rows extend the sequences further
                    s, depth = seqs[j % n_seq], j // n_seq
                    b.add_seq(s, ids[j % prefix : j % prefix + 1], prefix + depth, 1)
                t0 = time.perf_counter()
                self.ctx.decode(b)
                times.append(time.perf_counter() - t0)
                for s in seqs:
                    self.ctx.seq_rm(s, prefix, -1)
            out[n] = float(np.median(times[1:]))
        for s in seqs:
            self.ctx.clear_seq(s)
        self._costs = out
        return out


def draft_n_ctx(cfg: DraftModelConfig, target_n_ctx: int, slots: int, cross_vocab: bool) -> int:
    """Draft context cells: the target's, 1.5x through text (a smaller vocabulary needs more tokens), plus
    room for each slot's draft tokens."""
    if cfg.n_ctx is not None:
        return cfg.n_ctx
    return int(target_n_ctx * (1.5 if cross_vocab else 1.0)) + 16 * slots


class DraftModel:
    """A loaded draft model + context, paired with a target vocabulary."""

    def __init__(self, cfg: DraftModelConfig, target: Model, *, slots: int, target_n_ctx: int, n_batch: int = 512,
                 threads: int = 2, calibrate: bool = True) -> None:
        if not cfg.model:
            raise ValueError("no draft model configured")
        self.config = cfg
        self.model = Model(cfg.model)
        self.mismatch: VocabMismatch | None = vocab_mismatch(target, self.model)
        if self.mismatch is not None and not cfg.cross_vocab:
            self.model.close()
            raise VocabMismatchError(self.mismatch, target.name, cfg.model)
        self.translator = None
        if self.mismatch is not None:
            skip = frozenset({target.bos}) if target.bos >= 0 else frozenset()
            self.translator = TargetText(ModelTextVocab(target), skip)
        self.ctx = Context(self.model, n_ctx=draft_n_ctx(cfg, target_n_ctx, slots, self.translator is not None),
                           n_seq_max=slots, n_batch=n_batch, n_threads=cfg.threads or threads, kv_unified=True)
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
            "decode_cost_ms": {k: v * 1000 for k, v in self.backend.decode_costs().items()},
        }

    def close(self) -> None:
        self.ctx.close()
        self.model.close()
