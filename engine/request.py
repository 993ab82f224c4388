"""A generation request and the sequence that serves it."""

from __future__ import annotations

import codecs
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .sampling import SamplingParams

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    prompt_tokens: np.ndarray  # int32
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    chain: tuple[str, ...] | None = None  # None: the engine's chain; () : no speculation
    n_max: int | None = None  # per-request draft cap (<= the chain's)
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


class SeqState(str, Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class SpecCounters:
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_acceptance_length": 1.0 + self.accepted / self.drafts if self.drafts else 1.0,
        }


class Sequence:
    """Router-side state of one request."""

    def __init__(self, req: GenerationRequest, chain: tuple[str, ...], n_max: int, reserve: int) -> None:
        self.req = req
        self.id = req.request_id
        self.chain = chain
        self.n_max = n_max
        self.reserve = reserve  # KV cells held for it while it runs
        self.slot: int = -1
        self.state = SeqState.QUEUED
        self.n_prefilled = 0  # prompt tokens already in the KV cache
        self.n_past = 0  # tokens in the KV cache
        self.generated: list[int] = []
        self.history = np.asarray(req.prompt_tokens, dtype=np.int32).copy()
        self._hist_len = len(self.history)
        self.text = ""
        self._pending_text = ""  # held back: could be the start of a stop string
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.finish_reason: str | None = None
        # top-2 logit margin per generated token (record_margins), plus the end-of-generation token's when
        # it stopped on one: the bench classifies a divergence by the margin where it began
        self.margins: list[float] = []
        self.spec_total = SpecCounters()
        self.spec_by_name: dict[str, SpecCounters] = {}
        self.rounds = 0
        self.t_submit = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_finish: float | None = None
        self.cancelled = False

    @property
    def finished(self) -> bool:
        return self.state == SeqState.FINISHED

    @property
    def tokens_left(self) -> int:
        return self.req.max_tokens - len(self.generated)

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    def history_view(self) -> np.ndarray:
        return self.history[: self._hist_len]

    def append_tokens(self, toks: np.ndarray) -> None:
        n = len(toks)
        if self._hist_len + n > len(self.history):
            grow = np.zeros(max(len(self.history), n + 64), dtype=np.int32)
            self.history = np.concatenate([self.history[: self._hist_len], grow])
        self.history[self._hist_len : self._hist_len + n] = toks
        self._hist_len += n
        self.generated.extend(int(t) for t in toks)

    def feed_text(self, piece: bytes, final: bool = False) -> str:
        """Decode bytes incrementally; return text safe to emit (stop strings held back)."""
        self._pending_text += self._utf8.decode(piece, final=final)
        stops = self.req.stop
        if stops:
            for s in stops:
                idx = self._pending_text.find(s)
                if idx >= 0:
                    out = self._pending_text[:idx]
                    self._pending_text = ""
                    self.text += out
                    self.finish_reason = "stop"
                    return out
            if not final:
                hold = 0
                for s in stops:
                    for k in range(min(len(s) - 1, len(self._pending_text)), 0, -1):
                        if self._pending_text.endswith(s[:k]):
                            hold = max(hold, k)
                            break
                out = self._pending_text[: len(self._pending_text) - hold]
                self._pending_text = self._pending_text[len(out):]
                self.text += out
                return out
        out, self._pending_text = self._pending_text, ""
        self.text += out
        return out

    def count_spec(self, name: str | None, n_drafted: int, n_accepted: int) -> None:
        if not name or n_drafted <= 0:
            return
        for c in (self.spec_total, self.spec_by_name.setdefault(name, SpecCounters())):
            c.drafts += 1
            c.drafted += n_drafted
            c.accepted += n_accepted

    def spec_summary(self) -> dict:
        d = self.spec_total.to_dict()
        d["by_speculator"] = {k: v.to_dict() for k, v in self.spec_by_name.items()}
        return d
