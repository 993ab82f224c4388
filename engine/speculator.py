"""The speculator interface (as llama.cpp's common/speculative) and its stats.

Life of a sequence, seen by a speculator:

    begin(seq_id, prompt)              once, before the first draft
    process(seq_id, tokens, pos)       every batch the target decodes for the
                                       sequence (prompt chunks, accepted
                                       tokens); model-free speculators ignore it
    draft([DraftRequest, ...])         propose up to n_max tokens per sequence
    branches(seq_id, main, width)      runner-up continuations beside its last
                                       draft, for a draft tree (optional)
    accept(seq_id, n_accepted, winner) how many of its last draft the target
                                       kept; winner=False if another speculator
                                       of the chain was chosen this round
    end(seq_id)                        the sequence is finished; drop its state

`DraftRequest.history` is the whole token sequence so far: prompt + generated,
ending with the last sampled token (which the target has not decoded yet). A
draft continues after that last token. Model-free speculators read history
directly, so they need no mirror of the target's KV cache.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOKEN_DTYPE = np.int32
EMPTY_DRAFT = np.zeros(0, dtype=TOKEN_DTYPE)


@dataclass
class DraftRequest:
    """One sequence asking for a draft this round."""

    seq_id: int
    history: np.ndarray  # int32, prompt + generated, ends with the last sampled token
    n_max: int  # at most this many draft tokens (already capped by context room / tokens left)


@dataclass
class SpeculatorStats:
    """Counters in the style of llama.cpp / vLLM spec-decode metrics."""

    calls: int = 0  # draft() calls
    drafts_generated: int = 0  # non-empty drafts proposed
    drafts_accepted: int = 0  # drafts that were chosen and had >= 1 token accepted
    tokens_generated: int = 0  # draft tokens proposed (chosen drafts only)
    tokens_accepted: int = 0  # draft tokens the target kept
    drafts_chosen: int = 0  # drafts actually sent to the target (chain winner)
    accepted_per_pos: list[int] = field(default_factory=list)  # [i] = drafts with >= i+1 accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [i] = drafts with length >= i+1
    time_begin_s: float = 0.0
    time_draft_s: float = 0.0
    time_accept_s: float = 0.0
    # sequences that started from a finished one's kept index (speculators/kept_states.py), and the tokens they
    # did not index again
    continued: int = 0
    continued_tokens: int = 0

    def record_verdict(self, n_drafted: int, n_accepted: int) -> None:
        """Count one chosen draft of n_drafted tokens, n_accepted of them kept."""
        self.drafts_chosen += 1
        self.tokens_generated += n_drafted
        self.tokens_accepted += n_accepted
        if n_accepted > 0:
            self.drafts_accepted += 1
        need = max(n_drafted, len(self.drafted_per_pos))
        for arr in (self.drafted_per_pos, self.accepted_per_pos):
            arr.extend([0] * (need - len(arr)))
        for i in range(n_drafted):
            self.drafted_per_pos[i] += 1
        for i in range(n_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.tokens_accepted / self.tokens_generated if self.tokens_generated else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens gained per verified draft, counting the bonus token."""
        return 1.0 + self.tokens_accepted / self.drafts_chosen if self.drafts_chosen else 1.0

    def merge(self, other: "SpeculatorStats") -> None:
        for name in ("calls", "drafts_generated", "drafts_accepted", "tokens_generated",
                     "tokens_accepted", "drafts_chosen", "continued", "continued_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("time_begin_s", "time_draft_s", "time_accept_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_per_pos", "drafted_per_pos"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "drafts_generated": self.drafts_generated,
            "drafts_chosen": self.drafts_chosen,
            "drafts_accepted": self.drafts_accepted,
            "tokens_generated": self.tokens_generated,
            "tokens_accepted": self.tokens_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "time_begin_s": self.time_begin_s,
            "time_draft_s": self.time_draft_s,
            "time_accept_s": self.time_accept_s,
            "continued": self.continued,
            "continued_tokens": self.continued_tokens,
        }


class Speculator(ABC):
    """Base class. Subclasses implement `_draft_one` (or override `draft`).

    The public methods wrap the subclass hooks with timing and stats so every
    speculator reports the same counters.
    """

    name: str = "base"
    #: relative cost of drafting one token, in target-decode-steps (model-free ~0)
    cost_per_token: float = 0.0
    #: whether `branches` can return runner-ups (a tree's other branches)
    offers_branches: bool = False

    def __init__(self) -> None:
        self.stats = SpeculatorStats()
        self._last_draft_len: dict[int, int] = {}

    # ---- public interface -------------------------------------------------
    def begin(self, seq_id: int, prompt: np.ndarray) -> None:
        t0 = time.perf_counter()
        self._begin(seq_id, np.asarray(prompt, dtype=TOKEN_DTYPE))
        self.stats.time_begin_s += time.perf_counter() - t0

    def prefilling(self, seq_id: int, n: int) -> None:
        """The target prefills seq_id's prompt up to its token `n` this round (a long prompt takes many rounds,
        a chunk each). A speculator that indexes the prompt indexes it up to there, so a long prompt's indexing
        is spread over the rounds of its prefill instead of stalling the one that admits it; whatever is left
        when it first drafts, it indexes then. Timed as set-up (`time_begin_s`).

        >>> from specray.engine.speculators.ngram_cache import NgramCacheSpeculator
        >>> s = NgramCacheSpeculator(); s.begin(0, np.arange(600) % 50)
        >>> s.indexed(0), (s.prefilling(0, 256), s.indexed(0))[1], (s.prefilling(0, 600), s.indexed(0))[1]
        (0, 256, 600)
        """
        t0 = time.perf_counter()
        self._prefilling(seq_id, n)
        self.stats.time_begin_s += time.perf_counter() - t0

    def process(self, seq_id: int, tokens: np.ndarray, pos: int) -> None:
        """Mirror of a target batch for this sequence. Model-free: no-op."""

    def draft(self, requests: list[DraftRequest]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = []
        for req in requests:
            if req.n_max <= 0 or len(req.history) == 0:
                d = EMPTY_DRAFT
            else:
                d = np.asarray(self._draft_one(req), dtype=TOKEN_DTYPE)[: req.n_max]
            self.stats.calls += 1
            if len(d):
                self.stats.drafts_generated += 1
            out.append(d)
        self.stats.time_draft_s += time.perf_counter() - t0
        return out

    def branches(self, seq_id: int, main: np.ndarray, width: int) -> list:
        """Up to `width` runner-up continuations (draft_tree.Branch), most likely first, that this speculator
        holds beside `main`, its last draft for seq_id: the other branches of a draft tree. Asked right after
        `draft`, in the same round; none where its last draft was not `main`. Speculators that hold one
        continuation return none."""
        if not self.offers_branches or width <= 0 or not len(main):
            return []
        t0 = time.perf_counter()
        out = self._branches(seq_id, [int(t) for t in main], width)[:width]
        self.stats.time_draft_s += time.perf_counter() - t0
        return out

    def accept(self, seq_id: int, n_drafted: int, n_accepted: int, winner: bool) -> None:
        """Verdict on this speculator's last draft for seq_id.

        winner=True: its draft was verified (n_drafted tokens sent, n_accepted kept).
        winner=False: another speculator's draft was used; n_* describe that one.
        """
        t0 = time.perf_counter()
        if winner:
            self.stats.record_verdict(n_drafted, n_accepted)
        self._accept(seq_id, n_drafted, n_accepted, winner)
        self.stats.time_accept_s += time.perf_counter() - t0

    def end(self, seq_id: int) -> None:
        self._last_draft_len.pop(seq_id, None)
        self._end(seq_id)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift (engine/context_shift.py): the target dropped seq_id's cells [n_keep, n_keep + n_discard)
        and moved the later ones back. Model-free speculators read the whole history, which stays: nothing to
        do. Whatever holds positions must follow (ModelSpeculator)."""

    def draft_context(self, seq_id: int) -> int:
        """A small bucket (0..7) describing seq_id's last draft, for the chain's acceptance estimate
        (e.g. how long a match it copies); 0 when the speculator has nothing to say."""
        return 0

    def get_state(self) -> Any:
        """Optional: a picklable snapshot of shared (cross-request) state."""
        return None

    def set_state(self, state: Any) -> None:
        """Optional: restore what get_state returned."""

    # ---- hooks for subclasses ---------------------------------------------
    def _begin(self, seq_id: int, prompt: np.ndarray) -> None:
        pass

    def _prefilling(self, seq_id: int, n: int) -> None:
        pass

    @abstractmethod
    def _draft_one(self, req: DraftRequest) -> np.ndarray:
        ...

    def _accept(self, seq_id: int, n_drafted: int, n_accepted: int, winner: bool) -> None:
        pass

    def _end(self, seq_id: int) -> None:
        pass

    def _branches(self, seq_id: int, main: list[int], width: int) -> list:
        return []


def blame(e: Exception, name: str) -> None:
    """Tag an exception raised while `name` works with `.speculator = name`, so whoever catches it (the
    scheduler) can disable that speculator instead of losing every draft of every round to it. The innermost
    tag wins: a nested call knows better which speculator failed. (Called from `except` clauses: a `try`
    costs nothing until it raises, where a context manager's enter and exit ran for every speculator, every
    round.)"""
    if getattr(e, "speculator", None) is None:
        e.speculator = name
        e.add_note(f"(raised by speculator {name!r})")
