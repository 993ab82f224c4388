"""Draft trees in the policy: the runner-up branches beside a chosen draft, priced as its tokens are.

A branch's tokens join the round's candidates with the probability that each is accepted, so the planner
(planner.py) takes a branch token only where it pays for its row, exactly as it takes a draft token. The first
token of a branch at depth j is accepted when the draft's tokens before j are and the target's token there is the
branch's: P = P_main(j - 1) x c, where c is the branch's conditional chance, estimated from the main token's
calibrated conditional acceptance a_j and the speculator's own count ratio w (the branch's count over the main
token's): c = min(1 - a_j, a_j x w x f), at most what the main token leaves. f is learnt per speculator from the
branches sent (`BranchCalibration`). Later tokens of a branch take the main draft's conditional acceptance at
their depth.

>>> import numpy as np
>>> from specray.engine.draft_tree import Branch
>>> main = np.array([0.5, 0.4, 0.3])        # calibrated prefix probabilities of the main draft
>>> branch_probs(main, Branch(0, np.array([7, 8]), 0.5), 1.0).round(3).tolist()   # c = min(0.5, 0.25)
[0.25, 0.2]
>>> branch_probs(main, Branch(2, np.array([9]), 1.0), 1.0).round(3).tolist()      # P(2 tokens) x min(0.25, 0.75)
[0.1]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..draft_tree import Branch, DraftTree
from ..speculator import blame

#: the learnt factor's bounds: the counts' ratio is a rough guide, not to be believed 10-fold either way
FACTOR_RANGE = (0.25, 4.0)


def branch_probs(main: np.ndarray, branch: Branch, factor: float) -> np.ndarray:
    """The probability that each token of `branch` is accepted, given the main draft's calibrated prefix
    probabilities `main` (module docstring)."""
    j = branch.at
    parent = 1.0 if j == 0 else float(main[j - 1])
    if parent <= 0.0 or j >= len(main):
        return np.zeros(len(branch.tokens))

    def cond(d: int) -> float:
        before = 1.0 if d == 0 else float(main[d - 1])
        return float(main[d]) / before if before > 0 else 0.0

    a = cond(j)
    p = parent * min(1.0 - a, a * branch.weight * factor)
    out = np.empty(len(branch.tokens))
    for i in range(len(branch.tokens)):
        if i:
            p *= cond(min(j + i, len(main) - 1))
        out[i] = p
    return out


def room_left(main: np.ndarray) -> float:
    """The most any branch's first token can be worth beside a draft with these prefix probabilities: what the
    main token leaves at its depth, P(j - 1) - P(j), at best.

    >>> room_left(np.array([0.9, 0.5, 0.45]))
    0.4
    """
    before, best = 1.0, 0.0
    for p in np.asarray(main, dtype=float).tolist():
        best = max(best, before - p)
        before = p
    return best


@dataclass
class BranchCalibration:
    """Per speculator: the branch first tokens' predicted chance (c, given their parent was reached) against
    what happened; factor() scales the counts' ratio by how it fared."""

    predicted: dict[str, float] = field(default_factory=dict)
    taken: dict[str, float] = field(default_factory=dict)

    def factor(self, name: str) -> float:
        f = (self.taken.get(name, 0.0) + 1.0) / (self.predicted.get(name, 0.0) + 1.0)
        return min(max(f, FACTOR_RANGE[0]), FACTOR_RANGE[1])

    def observe(self, name: str, chance: float, taken: bool) -> None:
        self.predicted[name] = self.predicted.get(name, 0.0) + chance
        self.taken[name] = self.taken.get(name, 0.0) + float(taken)


@dataclass
class BranchGate:
    """Per speculator: whether looking up its runner-ups pays for the host time the look-ups take, as the
    look-up gate judges drafts (lookup_gate.py). Each look-up's seconds are counted, and each tree's tokens won
    beyond its main draft (the accepted path's length past where it left the main draft, which a linear draft
    would have lost); they pay while tokens won x seconds per token >= seconds spent. A speculator learns over
    its first LEARN asks; past them, one that does not pay is asked one round in PROBE (so it is judged again
    as the traffic changes).

    >>> g = BranchGate()
    >>> all(g.ask("s", 0.001) for _ in range(BranchGate.LEARN))   # learning: always asked
    True
    >>> g.spent("s", 0.002 * BranchGate.LEARN); g.won("s", 1)       # 2 ms a look-up, one token won in all
    >>> sum(g.ask("s", 0.001) for _ in range(BranchGate.PROBE * 4))  # a token is worth 1 ms: probes only
    4
    """

    LEARN = 64
    PROBE = 16
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    asks: dict[str, int] = field(default_factory=dict)

    def ask(self, name: str, seconds_per_token: float) -> bool:
        n = self.asks[name] = self.asks.get(name, 0) + 1
        if n <= self.LEARN or self.tokens.get(name, 0) * seconds_per_token >= self.seconds.get(name, 0.0):
            return True
        return n % self.PROBE == 0

    def spent(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def won(self, name: str, tokens: int) -> None:
        self.tokens[name] = self.tokens.get(name, 0) + tokens

    def to_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "tokens_won": dict(self.tokens), "asks": dict(self.asks)}


@dataclass
class TreeCounters:
    """One speculator's trees: drafts sent as trees, their branches beside the main draft and nodes (rows), the
    accepted path's branch (by rank: 0 the main draft, 1 the first runner-up...) and accepted tokens."""

    drafts: int = 0
    branches: int = 0
    nodes: int = 0
    accepted_tokens: int = 0
    accepted_by_rank: list[int] = field(default_factory=list)

    def add(self, tree: DraftTree, rank: int, accepted: int) -> None:
        self.drafts += 1
        self.branches += tree.n_branches - 1
        self.nodes += len(tree)
        self.accepted_tokens += accepted
        self.accepted_by_rank.extend([0] * (rank + 1 - len(self.accepted_by_rank)))
        self.accepted_by_rank[rank] += 1

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "branches": self.branches, "nodes": self.nodes,
                "accepted_tokens": self.accepted_tokens, "accepted_by_rank": list(self.accepted_by_rank),
                "mean_accepted": self.accepted_tokens / self.drafts if self.drafts else 0.0}


def accepted_path(tree: DraftTree, emitted) -> tuple[list[int], int]:
    """The tree's nodes the target accepted, read off the tokens it emitted (the accepted tokens, then its own
    next one), and the accepted path's branch.

    >>> t = DraftTree.build([5, 6], [(0, [9, 4])])
    >>> accepted_path(t, [9, 4, 1]), accepted_path(t, [5, 2]), accepted_path(t, [3])
    (([2, 3], 1), ([0], 0), ([], 0))
    """
    node, path = -1, []
    for t in list(emitted)[:-1]:
        nxt = tree.child_of.get((node, int(t)))
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path, tree.branch_of(node)


class TreePlanner:
    """The policy's side of trees: which branches a round's drafts get asked for, their calibration, counters."""

    def __init__(self) -> None:
        self.calibration = BranchCalibration()
        self.gate = BranchGate()
        self.counters: dict[str, TreeCounters] = {}
        self.rounds = 0  # rounds with >= 1 drafting sequence
        self.tree_rounds = 0  # rounds that sent >= 1 tree
        self.sequence_drafts = 0  # sequences' drafts sent (linear or tree)
        # per proposal sent as a tree: each branch's first token's (branch index, predicted chance c)
        self._sent: dict[int, list[tuple[int, int, float]]] = {}

    def candidates(self, props, requests, speculator, width: int, pool: int, floor: float = 0.0,
                   seconds_per_token: float = 0.0) -> list[tuple[int, Branch, np.ndarray]]:
        """(proposal index, branch, prefix probabilities) of the runner-ups beside each proposal's draft:
        `width` per sequence at most and `pool` in all (the target's spare sequence ids), most likely first, each
        with a first token's chance of at least `floor` (planner.row_worth). A proposal none of whose branches
        could reach it (what its main draft leaves at any depth is below it) is not asked, nor one whose
        speculator's runner-ups have not paid for their look-ups (BranchGate, a token worth
        `seconds_per_token`). `speculator(name)` gives the chain's instance."""
        out: list[tuple[int, Branch, np.ndarray]] = []
        for i, (p, r) in enumerate(zip(props, requests)):
            if p.speculator is None or not r.tree or not len(p.tokens) or pool <= 0:
                continue
            spec = speculator(p.speculator)
            if (not spec.offers_branches or room_left(p.prefix_probs) < max(floor, 1e-9)
                    or not self.gate.ask(p.speculator, seconds_per_token)):
                continue
            f = self.calibration.factor(p.speculator)
            t0 = time.perf_counter()
            try:
                branches = spec.branches(p.seq_id, p.tokens, width)
            except Exception as e:
                blame(e, p.speculator)
                raise
            self.gate.spent(p.speculator, time.perf_counter() - t0)
            for b in branches:
                probs = branch_probs(p.prefix_probs, b, f)
                if len(probs) and probs[0] > 0.0 and probs[0] >= floor:
                    out.append((i, b, probs))
        out.sort(key=lambda c: -c[2][0])
        return out[:pool]

    def attach(self, props, cands, lengths: list[int], pool: int, limits: list[int]) -> None:
        """Give each proposal the branches the planner kept (`lengths`: tokens kept per candidate) whose
        parent the main draft still holds, within `pool` branches in all and `limits[i]` nodes per tree (the
        draft rows its sequence may send: the KV cells it was given room for)."""
        by_prop: dict[int, list[tuple[Branch, float]]] = {}
        taken: dict[int, set[tuple[int, int]]] = {}  # per proposal: (depth, first token) its tree holds
        nodes: dict[int, int] = {}  # per proposal: its tree's nodes so far
        used = 0
        for (i, b, probs), n in zip(cands, lengths):
            p = props[i]
            if n <= 0 or b.at > len(p.tokens) - 1 or used >= pool:
                continue
            held = taken.setdefault(i, set(enumerate(p.tokens.tolist())))
            n = min(n, limits[i] - nodes.setdefault(i, len(p.tokens)))
            if n <= 0 or (b.at, int(b.tokens[0])) in held:  # the main draft's token there, or another branch's
                continue
            held.add((b.at, int(b.tokens[0])))
            nodes[i] += n
            parent = 1.0 if b.at == 0 else float(p.prefix_probs[b.at - 1])
            by_prop.setdefault(i, []).append((Branch(b.at, b.tokens[:n], b.weight), probs[0] / parent))
            used += 1
        for i, branches in by_prop.items():
            tree = DraftTree.build(props[i].tokens, [b for b, _ in branches])
            if tree.is_linear:
                continue
            props[i].tree = tree
            self._sent[props[i].seq_id] = [(k + 1, b.at, c) for k, (b, c) in enumerate(branches)]

    def withdraw(self, prop) -> None:
        """The proposal goes as its main draft alone (the batch has no room for its tree)."""
        if prop.tree is not None:
            prop.tree = None
            self._sent.pop(prop.seq_id, None)

    def round_sent(self, props) -> None:
        drafting = [p for p in props if len(p.tokens)]
        if drafting:
            self.rounds += 1
            self.sequence_drafts += len(drafting)
            if any(p.tree is not None for p in drafting):
                self.tree_rounds += 1

    def judge(self, prop, emitted) -> None:
        """A tree proposal's verdict: its counters, and each branch whose parent was reached teaches the
        calibration whether the target took it."""
        sent = self._sent.pop(prop.seq_id, None)
        if prop.tree is None or emitted is None:
            return
        path, rank = accepted_path(prop.tree, emitted)
        self.counters.setdefault(prop.speculator, TreeCounters()).add(prop.tree, rank, len(path))
        main_kept = 0
        for n in path:
            if n >= prop.tree.n_main:
                break
            main_kept += 1
        for branch, at, chance in sent or ():
            if main_kept >= at:  # its parent was reached: the target chose between the main token and it
                self.calibration.observe(prop.speculator, chance, rank == branch and main_kept == at)
        if rank > 0:  # a linear draft would have kept main_kept tokens
            self.gate.won(prop.speculator, len(path) - main_kept)

    def counter_dicts(self) -> dict[str, dict]:
        return {k: v.to_dict() for k, v in self.counters.items()}

    def snapshot(self) -> dict:
        return {"rounds": self.rounds, "tree_rounds": self.tree_rounds,
                "tree_round_share": self.tree_rounds / self.rounds if self.rounds else 0.0,
                "sequence_drafts": self.sequence_drafts,
                "by_speculator": {k: v.to_dict() for k, v in self.counters.items()},
                "branch_factor": {k: float(self.calibration.factor(k)) for k in self.calibration.predicted},
                "branch_lookups": self.gate.to_dict()}
