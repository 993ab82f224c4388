"""A chain of speculators and the policy that picks one draft per sequence.

Speculator instances are shared by every sequence of an engine (their global
tables and trees learn across requests); each sequence names the chain it
uses (the engine default, or its own per-request subset).

Policies:
- first:    llama.cpp's: speculators are asked in order; the first non-empty
            draft wins; the rest are not asked.
- expected: every speculator drafts; highest acceptance rate x draft length.
- cost:     every speculator drafts; highest expected accepted tokens under
            the per-sequence acceptance estimate; the scheduler then cuts each
            draft to the length that maximises expected tokens per second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .acceptance import AcceptanceTracker
from .config import ChainConfig
from .speculator import EMPTY_DRAFT, DraftRequest, Speculator, SpeculatorStats


@dataclass
class Proposal:
    """The draft chosen for one sequence this round."""

    seq_id: int
    speculator: str | None  # None: no draft
    tokens: np.ndarray = field(default_factory=lambda: EMPTY_DRAFT)
    prefix_probs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    asked: tuple[str, ...] = ()  # speculators that drafted for it this round

    def cut(self, n: int) -> None:
        self.tokens = self.tokens[:n]
        self.prefix_probs = self.prefix_probs[:n]
        if n == 0:
            self.speculator = None


@dataclass
class SeqDraftRequest:
    seq_id: int
    chain: tuple[str, ...]
    history: np.ndarray
    n_max: int


class Chain:
    def __init__(self, config: ChainConfig, factory: Callable[[str, dict | None], Speculator]) -> None:
        self.config = config
        self._factory = factory
        self.instances: dict[str, Speculator] = {}
        self.trackers: dict[str, AcceptanceTracker] = {}
        for name in config.speculators:
            self.speculator(name)  # fail fast on unknown names / bad params

    def speculator(self, name: str) -> Speculator:
        spec = self.instances.get(name)
        if spec is None:
            spec = self._factory(name, self.config.params.get(name))
            self.instances[name] = spec
            self.trackers[name] = AcceptanceTracker()
        return spec

    def validate(self, names: tuple[str, ...]) -> None:
        for name in names:
            self.speculator(name)

    # ---- sequence life -----------------------------------------------------------
    def begin(self, seq_id: int, names: tuple[str, ...], prompt: np.ndarray) -> None:
        for name in names:
            self.speculator(name).begin(seq_id, prompt)

    def end(self, seq_id: int, names: tuple[str, ...]) -> None:
        for name in names:
            self.instances[name].end(seq_id)
            self.trackers[name].end(seq_id)

    # ---- drafting ------------------------------------------------------------------
    def propose(self, requests: list[SeqDraftRequest], policy: str | None = None) -> list[Proposal]:
        policy = policy or self.config.policy
        props = [Proposal(r.seq_id, None) for r in requests]
        pending = [i for i, r in enumerate(requests) if r.chain and r.n_max > 0]
        if not pending:
            return props
        names_in_order: list[str] = []
        for i in pending:
            for n in requests[i].chain:
                if n not in names_in_order:
                    names_in_order.append(n)
        best_score = [-1.0] * len(requests)
        for name in names_in_order:
            idx = [i for i in pending if name in requests[i].chain]
            if policy == "first":
                idx = [i for i in idx if props[i].speculator is None]
            if not idx:
                continue
            spec = self.instances[name]
            drafts = spec.draft(
                [DraftRequest(requests[i].seq_id, requests[i].history, requests[i].n_max) for i in idx]
            )
            tracker = self.trackers[name]
            for i, d in zip(idx, drafts):
                props[i].asked += (name,)
                if len(d) == 0:
                    continue
                if policy == "first":
                    if props[i].speculator is None:
                        props[i].speculator, props[i].tokens = name, d
                        props[i].prefix_probs = tracker.prefix_probs(requests[i].seq_id, len(d))
                    continue
                pp = tracker.prefix_probs(requests[i].seq_id, len(d))
                score = tracker.rate(requests[i].seq_id) * len(d) if policy == "expected" else float(pp.sum())
                if score > best_score[i]:
                    best_score[i] = score
                    props[i].speculator, props[i].tokens, props[i].prefix_probs = name, d, pp
        return props

    def accept(self, prop: Proposal, n_drafted: int, n_accepted: int) -> None:
        """Tell every speculator asked for this sequence how its round went."""
        for name in prop.asked:
            winner = name == prop.speculator and n_drafted > 0
            self.instances[name].accept(prop.seq_id, n_drafted, n_accepted, winner)
            if winner:
                self.trackers[name].update(prop.seq_id, n_drafted, n_accepted)

    def stats(self) -> dict[str, SpeculatorStats]:
        return {name: spec.stats for name, spec in self.instances.items()}
