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
            Model speculators (a draft model: time per draft step) are asked
            last, and only for sequences where their expected accepted tokens
            beat the draft a free speculator already offers AND pay for the
            draft time (the planner with the draft time as a fixed cost per
            sequence); elsewhere they are not run at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .acceptance import AcceptanceTracker
from .config import ChainConfig
from .planner import plan_draft_lengths
from .speculator import EMPTY_DRAFT, DraftRequest, Speculator, SpeculatorStats
from .speculators.draft_base import ModelSpeculator


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
    tokens_left: int | None = None  # tokens the sequence may still generate (prices a model's catch-up)


@dataclass
class Pricing:
    """What a round costs, for pricing model drafts before they are made (cost policy)."""

    cost: Callable[[int], float]  # seconds of a target decode of n tokens
    base_tokens: int  # tokens the round's target batch holds without drafts
    n_decoding: int  # sequences that emit a token this round anyway
    explore: float = 0.0  # chance that a model draft the price rules out is made anyway (1 token), to learn
    rng: np.random.Generator | None = None


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

    def process(self, seq_id: int, names: tuple[str, ...], tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos... of seq_id (mirrored by model speculators)."""
        for name in names:
            self.instances[name].process(seq_id, tokens, pos)

    # ---- drafting ------------------------------------------------------------------
    def propose(
        self, requests: list[SeqDraftRequest], policy: str | None = None, pricing: Pricing | None = None
    ) -> list[Proposal]:
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
        if policy == "cost":  # free speculators first: a model draft must beat what they offer
            names_in_order.sort(key=lambda n: isinstance(self.instances[n], ModelSpeculator))
        best_score = [-1.0] * len(requests)
        for name in names_in_order:
            idx = [i for i in pending if name in requests[i].chain]
            if policy == "first":
                idx = [i for i in idx if props[i].speculator is None]
            if not idx:
                continue
            spec = self.instances[name]
            n_max = {i: requests[i].n_max for i in idx}
            if policy == "cost" and pricing is not None and isinstance(spec, ModelSpeculator):
                n_max = self._price(name, spec, idx, requests, best_score, pricing)
                idx = [i for i in idx if i in n_max]
                if not idx:
                    continue
            drafts = spec.draft([DraftRequest(requests[i].seq_id, requests[i].history, n_max[i]) for i in idx])
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

    def _price(
        self, name: str, spec: ModelSpeculator, idx: list[int], requests: list[SeqDraftRequest],
        best_score: list[float], pricing: Pricing,
    ) -> dict[int, int]:
        """Which sequences a model speculator drafts for this round, and how many tokens each: only where
        its expected accepted tokens beat the best free draft, and the planner finds the draft time worth
        paying: the draft steps (shared among the sequences drafting together) plus, per sequence, the
        catch-up of a draft cache that lags (up to its whole prompt), spread over the rounds the sequence
        has left, since it is paid once. {request index: n_max}."""
        tracker = self.trackers[name]
        cands: list[int] = []
        probs: list[np.ndarray] = []
        for i in idx:
            pp = tracker.prefix_probs(requests[i].seq_id, min(requests[i].n_max, spec.max_steps))
            if len(pp) and float(pp.sum()) > best_score[i]:
                cands.append(i)
                probs.append(pp)
        if not cands:
            return {}
        share = spec.draft_seconds(len(cands), max(len(p) for p in probs)) / len(cands)
        catchup = [spec.catchup_seconds(requests[i].seq_id, requests[i].history) for i in cands]
        extra = []
        for i, pp, c in zip(cands, probs, catchup):
            rounds_left = (requests[i].tokens_left or 64) / (1.0 + float(pp.sum()))
            extra.append(share + c / max(1.0, rounds_left))
        lengths = plan_draft_lengths(probs, pricing.base_tokens, pricing.cost, n_decoding=pricing.n_decoding,
                                     extra_seconds=extra)
        # a draft cut this short must still beat the free one, or its time is wasted
        chosen = {i: k for i, k, pp in zip(cands, lengths, probs) if k > 0 and float(pp[:k].sum()) > best_score[i]}
        if not chosen and pricing.explore and pricing.rng is not None and pricing.rng.random() < pricing.explore:
            # keep measuring the model's acceptance, but cheaply: a 1-token draft for a sequence whose draft
            # cache is current (a long catch-up would cost more than the draft); while the speculator has
            # hardly been measured at all, the cheapest catch-up is paid
            j = min(range(len(cands)), key=lambda c: catchup[c])
            if catchup[j] <= share or tracker.global_trials < 16:
                chosen = {cands[j]: 1}
        return chosen

    def accept(self, prop: Proposal, n_drafted: int, n_accepted: int) -> None:
        """Tell every speculator asked for this sequence how its round went."""
        for name in prop.asked:
            winner = name == prop.speculator and n_drafted > 0
            self.instances[name].accept(prop.seq_id, n_drafted, n_accepted, winner)
            if winner:
                self.trackers[name].update(prop.seq_id, n_drafted, n_accepted)

    def stats(self) -> dict[str, SpeculatorStats]:
        return {name: spec.stats for name, spec in self.instances.items()}
