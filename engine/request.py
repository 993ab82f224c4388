"""A generation request and the sequence that serves it."""

from __future__ import annotations

import codecs
import functools
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from .sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from .config import ChainConfig

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    prompt_tokens: np.ndarray  # int32
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    chain: tuple[str, ...] | None = None  # None: the engine's chain; () : no speculation
    n_max: int | None = None  # per-request draft cap (<= the chain's)
    tree: bool = True  # False: linear drafts only (no draft trees: engine/draft_tree.py)
    ignore_eos: bool = False
    cache_prompt: bool = True  # may reuse a slot's cached KV of a common prefix (engine/prompt_cache.py)
    # tuning (engine/policy/tuning.py, ChainConfig.tune): the request's sequence class (None: configured parameters)
    tune_class: str | None = "default"
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    # requests with the same key and prompt share the prompt's KV cells (OpenAI's n > 1): the first one
    # prefills, the others copy its cells (prompt_share.py: Scheduler.submit links them, Scheduler._admit
    # copies)
    share_prompt: str | None = None
    # context shift (context_shift.py): None takes the engine's setting (EngineConfig.context_shift/n_keep/n_discard)
    context_shift: bool | None = None
    n_keep: int | None = None
    n_discard: int | None = None


def admission_plan(req: GenerationRequest, chain: "ChainConfig", n_ctx: int | None,
                   shift: bool = False) -> tuple[tuple[str, ...], int, int]:
    """(speculator names, draft cap, KV cells to reserve) of a request under the engine's chain config; a
    sequence may use n_ctx cells (None: no context check, e.g. to learn what a prompt would need).
    shift: the sequence shifts its context when full (context_shift.py): only its prompt must fit, and it
    reserves at most the context. ValueError for a request that cannot run.

    >>> from specray.engine.config import ChainConfig
    >>> req = GenerationRequest(np.arange(10, dtype=np.int32), max_tokens=20, n_max=4)
    >>> admission_plan(req, ChainConfig(speculators=["suffix"], n_max=8), 64)
    (('suffix',), 4, 35)
    >>> admission_plan(req, ChainConfig(speculators=["suffix"], n_max=8), 32)
    Traceback (most recent call last):
    ...
    ValueError: prompt (10 tokens) + max_tokens (20) exceeds the context of 32 tokens
    >>> admission_plan(req, ChainConfig(speculators=["suffix"], n_max=8), None)[2]
    35
    >>> admission_plan(req, ChainConfig(speculators=["suffix"], n_max=8), 32, shift=True)
    (('suffix',), 4, 32)
    """
    n_prompt = len(req.prompt_tokens)
    if n_prompt == 0:
        raise ValueError("prompt is empty")
    if req.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
    names = tuple(chain.speculators) if req.chain is None else tuple(req.chain)
    n_max = chain.n_max if req.n_max is None else req.n_max
    if n_max < 0:
        raise ValueError(f"n_max must be >= 0, got {n_max}")
    n_max = min(n_max, chain.n_max) if names else 0
    need = n_prompt + req.max_tokens + n_max + 1
    if n_ctx is not None and n_prompt >= n_ctx:
        raise ValueError(f"prompt of {n_prompt} tokens does not fit the context of {n_ctx} tokens")
    if n_ctx is not None and shift:
        return names, n_max, min(need, n_ctx)
    if n_ctx is not None and need > n_ctx:
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({req.max_tokens}) exceeds the context of "
                         f"{n_ctx} tokens")
    return names, n_max, need


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
        self.replay_rows = 0  # committed rows the target decodes again before its next verify (rollback.py)
        self.cached_tokens = 0  # prompt tokens found in the slot's KV (prompt cache), not prefilled
        self.generated: list[int] = []
        self.history = np.asarray(req.prompt_tokens, dtype=np.int32).copy()
        self._hist_len = len(self.history)
        self.text = ""
        self._pending_text = ""  # held back: could be the start of a stop string
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.finish_reason: str | None = None
        self.error: str | None = None  # finish_reason "error": why the target could not go on with it
        self.logprobs: list = []  # logprobs.TokenLogprobs of the generated tokens, a chunk per round (if asked)
        self.prompt_logprobs: list = []  # echo: TokenLogprobs of prompt tokens 1.. (the first has none), by chunk
        self.prompt_logprobs_sent = False  # they go out with the first event
        # top-2 logit margin per generated token (record_margins), plus the end-of-generation token's when
        # it stopped on one: the bench classifies a divergence by the margin where it began
        self.margins: list[float] = []
        self.spec_total = SpecCounters()
        self.spec_by_name: dict[str, SpecCounters] = {}
        self.rounds = 0
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None  # got its slot (the serve path's per-stage timing starts rounds here)
        self.t_first_token: float | None = None
        self.t_finish: float | None = None
        self.cancelled = False
        self.fork_of: Sequence | None = None  # copies this sequence's prompt cells when admitted (share_prompt)
        # context shift (context_shift.py): cells kept at the front (None: never shifted), tokens discarded
        # after them in all, and the shift the target applies with this sequence's next rows
        self.shift_keep: int | None = None
        self.shifted = 0
        self.shifts = 0
        self.pending_shift: tuple[int, int] | None = None

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

    def shift(self, keep: int, discard: int) -> None:
        """The sequence's cells [keep, keep + discard) go (context shift): the history stays whole (the n-gram
        speculators and the output read it), the KV positions move back by `discard`."""
        self.shift_keep = keep
        self.shifted += discard
        self.shifts += 1
        self.n_past -= discard
        self.pending_shift = (keep, discard)

    def take_shift(self) -> tuple[int, int] | None:
        """The shift the target still has to apply (once: with the sequence's next rows)."""
        shift, self.pending_shift = self.pending_shift, None
        return shift

    def kv_history(self) -> np.ndarray:
        """The tokens of the sequence's KV cells by position, then the last sampled token: the history less
        what context shifts discarded (the history itself where none did)."""
        h = self.history_view()
        if self.shift_keep is None:
            return h
        return np.concatenate([h[: self.shift_keep], h[self.shift_keep + self.shifted :]])

    def kv_prefix(self) -> np.ndarray:
        """The tokens whose cells a later prompt may reuse (the prompt cache): those up to n_past, or after a
        context shift only the kept front, whose cells never saw the shift; later cells attended to discarded
        tokens and were moved, so a fresh prefill of their tokens would not give them."""
        h = self.history_view()
        return h[: self.n_past] if self.shift_keep is None else h[: min(self.shift_keep, self.n_past)]

    def append_tokens(self, toks: np.ndarray | list[int]) -> None:
        n = len(toks)
        if self._hist_len + n > len(self.history):
            grow = np.zeros(max(len(self.history), n + 64), dtype=np.int32)
            self.history = np.concatenate([self.history[: self._hist_len], grow])
        if n == 1:  # most rounds keep one token: an item write runs far less of numpy than a slice of a list
            self.history[self._hist_len] = toks[0]
        else:
            self.history[self._hist_len : self._hist_len + n] = toks
        self._hist_len += n
        self.generated.extend(toks.tolist() if isinstance(toks, np.ndarray) else toks)

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

    def emit(self, toks: np.ndarray, margins: np.ndarray | None, tok) -> tuple[list[int], str]:
        """Take the tokens a round produced, up to the first that ends the sequence (end of generation unless
        ignore_eos, a stop string, max_tokens): returns (tokens kept, new text). Sets finish_reason when it ends
        (the caller frees the slot). `tok`: token_to_piece / is_eog of the target's vocabulary."""
        kept, text = self.take(toks, margins, tok)
        return kept, text if isinstance(text, str) else text()

    def take(self, toks: np.ndarray, margins: np.ndarray | None, tok) -> tuple[list[int], str | Callable[[], str]]:
        """`emit` in two halves: the tokens kept (and finish_reason) now, the text now where stop strings need it
        to decide, else a function that makes it later. An overlapped round calls that function while the next
        round decodes. Call each such function before this sequence's next `take`: an incremental decoder
        holds the text's state."""
        if self.t_first_token is None and len(toks):
            self.t_first_token = time.perf_counter()
        kept: list[int] = []
        text = ""
        # without stop strings the pieces are decoded in one go after the loop (an incremental decoder's text
        # does not depend on how its bytes are split): one decode a round, not one a token
        eog = None if self.req.ignore_eos else tok.is_eog
        room = self.req.max_tokens - len(self.generated)
        stops = bool(self.req.stop)
        for i, t in enumerate(toks.tolist() if isinstance(toks, np.ndarray) else [int(t) for t in toks]):
            if eog is not None and eog(t):
                self.finish_reason = "stop"
                if margins is not None:  # where the run chose to stop: a run that went on diverged here
                    self.margins.append(float(margins[i]))
                break
            kept.append(t)
            if margins is not None:
                self.margins.append(float(margins[i]))
            if stops:
                text += self.feed_text(tok.token_to_piece(t))
                if self.finish_reason == "stop":  # a stop string matched
                    break
            if len(kept) >= room:
                self.finish_reason = "length"
                break
        self.append_tokens(kept)
        final = self.finish_reason is not None and self.finish_reason != "stop"
        if stops:
            return kept, text + self.feed_text(b"", final=True) if final else text
        return kept, functools.partial(self._text_of, kept, tok, final)

    def _text_of(self, kept: list[int], tok, final: bool) -> str:
        """The text of tokens `take` kept (no stop strings: nothing of it decides where the sequence ends)."""
        out = self.feed_text(b"".join([tok.token_to_piece(t) for t in kept])) if kept else ""
        return out + self.feed_text(b"", final=True) if final else out

    def take_logprobs(self, lps, n_kept: int) -> tuple:
        """(the kept tokens' logprobs: a prefix of the round's TokenLogprobs, or None; the prompt's logprobs
        chunks with the first event of an echo request, else None), recorded on the sequence."""
        lps = None if lps is None else lps.head(n_kept)
        if lps is not None:
            self.logprobs.append(lps)
        plp = None
        if self.prompt_logprobs and not self.prompt_logprobs_sent:
            plp, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return lps, plp

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
