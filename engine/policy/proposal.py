"""What the scheduler asks the policy for each decoding sequence, and what the policy answers.

A `SeqDraftRequest` is one sequence's side of a round: its chain, its history
and how many draft tokens it may send. A `Proposal` is the draft the policy
chose for it, with the acceptance estimate it was priced at and every asked
speculator's whole draft (each is judged after the round, sent or not).

>>> import numpy as np
>>> p = Proposal(0, "suffix", np.array([5, 6, 7], np.int32), np.array([0.9, 0.7, 0.4]))
>>> p.cut(2); p.tokens.tolist(), p.prefix_probs.tolist()
([5, 6], [0.9, 0.7])
>>> p.cut(0); p.speculator is None
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..draft_tree import DraftTree
from ..speculator import EMPTY_DRAFT, Speculator
from ..speculators.draft_base import ModelSpeculator


@dataclass
class Proposal:
    """The draft chosen for one sequence this round."""

    seq_id: int
    speculator: str | None  # None: no draft
    tokens: np.ndarray = field(default_factory=lambda: EMPTY_DRAFT)
    prefix_probs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # calibrated
    raw_probs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the tracker's, scored after the verdict
    asked: tuple[str, ...] = ()  # speculators that drafted for it this round
    # every asked speculator's whole draft (before any cut) and its context bucket: after the round each
    # is judged against the tokens the target emitted, so every speculator learns, sent or not
    drafts: dict[str, np.ndarray] = field(default_factory=dict)
    contexts: dict[str, int] = field(default_factory=dict)
    # cost policy: each scored draft's draft_value; 0 = no prefix of it was worth its verify time (the look-up
    # gate counts such a draft as winning nothing once its speculator is learnt: lookup_gate.py)
    worth: dict[str, float] = field(default_factory=dict)
    rows_price: dict[str, np.ndarray] = field(default_factory=dict)  # probes' verify rows in tokens (judged_worth)
    # the draft as a tree (its main draft: `tokens`, then runner-up branches: engine/draft_tree.py); None: linear
    tree: DraftTree | None = None

    @property
    def rows(self) -> int:
        """Draft rows it sends: the tree's nodes, else its tokens."""
        return len(self.tree) if self.tree is not None else len(self.tokens)

    def cut(self, n: int) -> None:
        self.tree = None
        self.tokens = self.tokens[:n]
        self.prefix_probs = self.prefix_probs[:n]
        self.raw_probs = self.raw_probs[:n]
        if n == 0:
            self.speculator = None


@dataclass
class SeqDraftRequest:
    seq_id: int
    chain: tuple[str, ...]
    history: np.ndarray
    n_max: int
    tokens_left: int | None = None  # tokens the sequence may still generate (prices a model's catch-up)
    tune_class: str | None = "default"  # its class for tuning (None: configured parameters, not tuned)
    kv_history: np.ndarray | None = None  # after a context shift: the tokens by KV position (+ the last one)
    replay_rows: int = 0  # rows the target replays in front of its own (a restored recurrent state: rollback.py)
    tree: bool = False  # its draft may be a tree (the request allows it and its layout verifies one)

    def history_for(self, spec: Speculator) -> np.ndarray:
        """What `spec` drafts from: model speculators mirror the target's KV by position, so after a context
        shift they get the shifted tokens (context_shift.py); model-free ones the whole history."""
        return self.kv_history if self.kv_history is not None and isinstance(spec, ModelSpeculator) else self.history
