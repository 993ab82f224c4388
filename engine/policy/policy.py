"""The draft policy: per round, which drafts are sent and how much of each.

`DraftPolicy.plan_round` is the one entry point the scheduler calls, once per
round: given the decoding sequences' requests and the round's room, it asks
the chain's speculators (skipping look-ups that do not pay: lookup_gate.py;
pricing model drafts before they are made: model_drafts.py; with tuned
parameters: tuning.py), keeps each sequence's best draft (choose.py), cuts
it to the length that maximises expected tokens per second (planner.py) and
fits all of them to the batch's free rows. After the verify, `accept` takes
each sequence's verdict into the estimates and the gate, and `observe` takes
the round's timing into the prices (round_price.py, rollback_price.py).
`snapshot` reports it all for /v1/stats and the bench.

Policies (ChainConfig.policy):
- first:    llama.cpp's: speculators are asked in order; the first non-empty
            draft wins; the rest are not asked.
- expected: every speculator drafts; highest acceptance rate x draft length.
- cost:     every speculator drafts (unless gated); the draft worth most net
            of its verify time wins, then the planner cuts it. Model
            speculators are asked last, only where their priced draft beats
            the free one.

A speculator that raises is disabled and the round goes on without drafts
(never a lost round).

>>> import numpy as np
>>> from specray.engine.chain import Chain
>>> from specray.engine.config import ChainConfig
>>> from specray.engine.speculators.registry import speculator_factory
>>> config = ChainConfig(speculators=["ngram_simple"], params={"ngram_simple": {"size_n": 2, "size_m": 4}})
>>> chain = Chain(config, speculator_factory())
>>> policy = DraftPolicy(chain, DecodeCostModel({1: 0.010, 8: 0.011}, learn=False))   # rows nearly free
>>> history = np.array([0, 1, 2, 3, 4, 5, 6, 9, 1, 2], np.int32)
>>> chain.begin(0, ("ngram_simple",), history)
>>> [p] = policy.plan_round([SeqDraftRequest(0, ("ngram_simple",), history, 2)], Room(free_rows=8, base_rows=1))
>>> p.speculator, p.tokens.tolist()   # the prior acceptance pays for two cheap rows
('ngram_simple', [3, 4])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..chain import Chain, ChainChange
from ..cost import DecodeCostModel
from ..rollback import RollbackStats
from ..speculator import blame
from ..speculators.draft_base import ModelSpeculator
from .choose import score_drafts
from .estimates import CONTEXT_OWN_BUCKETS, ValueEstimates
from .lookup_gate import LookupGate
from .model_drafts import ModelDrafts
from .planner import fit_to_room, plan_draft_lengths, row_worth
from .pricing import Pricing, judged_worth
from .proposal import Proposal, SeqDraftRequest
from .rollback_price import RollbackPrice
from .round_price import RoundPricer
from .trees import TreePlanner
from .tuning import ParamTuner, make_tuner, tuned_look_up

log = logging.getLogger("specray.policy")

#: sizes a round's price curve is extended by at a time (base_rows up): one plain row and a draft of up to 16 rows
PRICE_RUN = 17


@dataclass
class Room:
    """A round's room for drafts. free_rows: rows the target batch has left; base_rows: rows it holds without
    drafts; cells: KV cells a token attends on average (the decode's price depends on them; None: unknown);
    rows(lengths): the batch's rows for these draft lengths where verifies are padded to fixed shapes
    (verify_shape.batch_rows), else None."""

    free_rows: int
    base_rows: int
    cells: float | None = None
    rows: Callable[[list[int]], int] | None = None
    tree_width: int = 0  # runner-up branches a sequence's draft may carry (draft trees; 0: linear drafts)
    tree_seqs: int = 0  # branches the round may carry in all (the target's spare sequence ids)


class DraftPolicy:
    """The chain's draft policy (module docstring). `cost`: the target decode's price model (default: learnt
    from the rounds); `rollback`: the target's rollback mode (TargetMemory.rollback), which prices a draft's
    state save and expected restore."""

    def __init__(self, chain: Chain, cost: DecodeCostModel | None = None, rollback: str = "trim",
                 seed: int = 0) -> None:
        self.chain = chain
        self.pricer = RoundPricer(cost or DecodeCostModel())  # the decode and the host's work, learnt
        self.rollback_price = RollbackPrice(rollback)
        self.estimates = ValueEstimates()
        self.gate = LookupGate()  # each speculator's look-ups: their host time, and whether its winnings pay
        self.models = ModelDrafts()
        self.trees = TreePlanner()  # runner-up branches beside drafts (trees.py)
        self.tuner: ParamTuner | None = self._make_tuner()
        self._explore_rng = np.random.default_rng(seed)  # deterministic: runs stay reproducible

    def for_chain(self, chain: Chain) -> DraftPolicy:
        """A policy for another chain on the same target (the bench compares chains on one engine, round by
        round): it prices rounds with this policy's pricer, which every chain's rounds teach, and learns its own
        estimates, gate and tuning."""
        other = DraftPolicy(chain, rollback=self.rollback_price.mode)
        other.pricer, other.rollback_price = self.pricer, self.rollback_price
        return other

    def _make_tuner(self) -> ParamTuner | None:
        return make_tuner(self.chain.config, self.chain.instances, lambda s: isinstance(s, ModelSpeculator))

    # the target decode's price model (settable: the pricer uses the new one)
    cost = property(lambda self: self.pricer.cost, lambda self, model: setattr(self.pricer, "cost", model))

    # ---- the round ------------------------------------------------------------------
    def plan_round(self, requests: list[SeqDraftRequest], room: Room, disabled: set[str] | None = None,
                   stats=None) -> list[Proposal]:
        """The drafts of one round, one Proposal per request, in order (empty where nothing pays or fits).
        A speculator that raises is added to `disabled`; the round then sends no drafts. `stats` (the
        scheduler's RoundStats, if given) counts the time spent drafting and the failures. Three cuts, in
        order: the best draft per sequence (model drafts priced before they are made); under `cost`, the
        planner's cut to the length that maximises expected tokens per second; finally all drafts together
        are scaled down to the batch's free rows."""
        if not any(r.chain and r.n_max > 0 for r in requests) or room.free_rows <= 0:
            return [Proposal(r.seq_id, None) for r in requests]
        config = self.chain.config
        n_decoding = len(requests)
        price = self.round_price(room.base_rows, n_decoding, room.cells)
        t0 = time.perf_counter()
        try:
            props = self.propose(requests, Pricing(price, room.base_rows, n_decoding, config.model_explore))
        except Exception as e:  # degrade to plain decoding this round, disable the culprit for the next ones
            culprit = getattr(e, "speculator", None)
            if stats is not None:
                stats.speculator_failures += 1
            if culprit:
                if disabled is not None:
                    disabled.add(culprit)
                log.exception("speculator %r failed while drafting; disabled (its sequences draft with the rest "
                              "of their chain)", culprit)
            else:
                log.exception("drafting failed (no speculator to blame); continuing without drafts this round")
            props = [Proposal(r.seq_id, None) for r in requests]
        if stats is not None:
            stats.draft_seconds += time.perf_counter() - t0
        cands: list = []
        if config.policy == "cost":
            fixed = self.rollback_price.fixed_list(price, room.base_rows, [r.replay_rows for r in requests])
            lengths = plan_draft_lengths([p.prefix_probs for p in props], room.base_rows, price,
                                         n_decoding=n_decoding, extra_seconds=fixed, rows=room.rows)
            if room.tree_width > 0 and room.rows is None and config.trees:  # branches, priced as tokens are
                floor = row_worth([p.prefix_probs for p in props], lengths, room.base_rows, n_decoding, price, fixed)
                cands = self._branch_candidates(props, requests, room, disabled, floor,
                                                price(room.base_rows) / n_decoding)
                if cands:
                    lengths = plan_draft_lengths([p.prefix_probs for p in props] + [c[2] for c in cands],
                                                 room.base_rows, price, n_decoding=n_decoding,
                                                 extra_seconds=None if fixed is None else fixed + [0.0] * len(cands))
            for p, k in zip(props, lengths):
                if k == 0 and len(p.tokens) and config.explore and self._explore_rng.random() < config.explore:
                    k = 1
                p.cut(k)
            if cands:
                self.trees.attach(props, cands, lengths[len(props):], room.tree_seqs, [r.n_max for r in requests])
        if sum(p.rows for p in props) > room.free_rows:  # trees give way first, then drafts shrink alike
            for p in props:
                self.trees.withdraw(p)
        for p, k in zip(props, fit_to_room([len(p.tokens) for p in props], room.free_rows)):
            if k < len(p.tokens):
                p.cut(k)
        self.trees.round_sent(props)
        return props

    def _branch_candidates(self, props: list[Proposal], requests: list[SeqDraftRequest], room: Room,
                           disabled: set[str] | None, floor: float, seconds_per_token: float) -> list:
        """The runner-up branches beside the round's drafts (trees.py) whose first token's chance reaches
        `floor`, where their look-ups pay (a token is worth `seconds_per_token`); a speculator that fails giving
        them is disabled as one that fails drafting is, and the round's drafts stay linear."""
        try:
            return self.trees.candidates(props, requests, self.chain.speculator, room.tree_width, room.tree_seqs,
                                         floor, seconds_per_token)
        except Exception as e:
            culprit = getattr(e, "speculator", None)
            if culprit and disabled is not None:
                disabled.add(culprit)
            log.exception("speculator %r failed giving runner-up branches; disabled, drafts stay linear", culprit)
            return []

    def round_price(self, base_rows: int, n_decoding: int, cells: float | None) -> Callable[[int], float]:
        """price(n): seconds of this round with n target rows (decode and host work), memoised for the round:
        drafts are priced token by token, by every speculator that offers one. The sizes from base_rows up are
        priced in runs (RoundPricer.prices), at least PRICE_RUN at a time."""
        run: list[float] = []  # the prices of base_rows, base_rows + 1, ... so far
        seen: dict[int, float] = {}  # of smaller sizes

        def price(n: int) -> float:
            k = n - base_rows
            if 0 <= k < len(run):
                return run[k]
            if k >= 0:
                n0 = base_rows + len(run)
                run.extend(self.pricer.prices(n0, max(n + 1, n0 + PRICE_RUN), base_rows, n_decoding, cells))
                return run[k]
            v = seen.get(n)
            if v is None:
                v = seen[n] = self.pricer.price(n, base_rows, n_decoding, cells)
            return v

        return price

    def propose(self, requests: list[SeqDraftRequest], pricing: Pricing | None = None,
                policy: str | None = None) -> list[Proposal]:
        """Ask the chain's speculators for the requests' drafts and keep each sequence's best (uncut).
        Without `pricing` nothing is gated or priced: every speculator of a request's chain is asked."""
        policy = policy or self.chain.config.policy
        props = [Proposal(r.seq_id, None) for r in requests]
        pending = [i for i, r in enumerate(requests) if r.chain and r.n_max > 0]
        if not pending:
            return props
        names: list[str] = list(dict.fromkeys(n for i in pending for n in requests[i].chain))
        if policy == "cost":  # free speculators first: a model draft must beat what they offer
            names.sort(key=self.chain.is_model)
        best_score = [-1.0] * len(requests)
        unscored: list[tuple[int, str]] = []  # drafts to score once every free speculator has drafted
        spt = None if pricing is None else pricing.seconds_per_token()
        for name in names:
            try:  # a failure is the speculator's: the scheduler disables it
                self._ask(name, requests, pending, props, best_score, unscored, policy, pricing, spt)
            except Exception as e:
                blame(e, name)
                raise
        score_drafts(self.estimates, props, unscored, best_score, policy, pricing, self.gate.probing)
        return props

    def _ask(self, name: str, requests: list[SeqDraftRequest], pending: list[int], props: list[Proposal],
             best_score: list[float], unscored: list[tuple[int, str]], policy: str, pricing: Pricing | None,
             spt: float | None) -> None:
        """One speculator's turn: whom to ask (gate, model pricing), the look-ups, and their drafts recorded."""
        idx = [i for i in pending if name in requests[i].chain]
        if policy == "first":
            idx = [i for i in idx if props[i].speculator is None]
        is_model = self.chain.is_model(name)
        if idx and pricing is not None and not is_model:  # gated: probes only
            idx = self.gate.ask(name, idx, [requests[i].seq_id for i in idx], spt)
        if not idx:
            return
        n_max = {i: requests[i].n_max for i in idx}
        exploring = False
        if policy == "cost" and pricing is not None and is_model:
            score_drafts(self.estimates, props, unscored, best_score, policy, pricing, self.gate.probing)
            n_max, exploring = self.models.price(name, self.chain.speculator(name), idx, requests, best_score,
                                                 pricing, self.estimates)
            idx = [i for i in idx if i in n_max]
            if not idx:
                return
        t0 = time.perf_counter()
        drafts = tuned_look_up(self.chain, name, [requests[i] for i in idx], [n_max[i] for i in idx], self.tuner,
                               pricing, self._shadow_estimate(name))
        dt = time.perf_counter() - t0
        if self.tuner is not None:  # shadow look-ups (tuning) are the tuner's cost, not the look-ups'
            dt -= self.tuner.take_seconds()
        self.gate.asked(name, len(idx), dt)
        if is_model:
            self.models.drafted(name, dt, exploring)
        for i, d in zip(idx, drafts):
            props[i].asked += (name,)
            if len(d) == 0:
                continue
            props[i].drafts[name] = d
            props[i].contexts[name] = self.chain.draft_context(name, requests[i].seq_id)
            if policy == "first":
                if props[i].speculator is None:
                    props[i].speculator, props[i].tokens = name, d
                    props[i].raw_probs, props[i].prefix_probs = self.estimates.estimate(
                        name, props[i].seq_id, len(d), props[i].contexts[name])
                continue
            unscored.append((i, name))

    def _shadow_estimate(self, name: str) -> Callable[[int, int], np.ndarray] | None:
        """The calibrated acceptance estimate of a shadow look-up's draft (tuning): (seq_id, length) -> prefix
        probs, in the speculator's own context bucket (a shadow has no other speculators' drafts to agree
        with)."""
        if self.tuner is None:
            return None
        return lambda sid, n: self.estimates.estimate(
            name, sid, n, min(self.chain.draft_context(name, sid), CONTEXT_OWN_BUCKETS - 1) * 3)[1]

    # ---- after the verify ------------------------------------------------------------
    def accept(self, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray | None = None) -> None:
        """One sequence's verdict: n_drafted tokens of `prop` sent, n_accepted of them accepted. The speculators
        asked for it are told (`tell`), and the estimates, the gate and the catch-up shares learn (`learn`).

        emitted: the tokens the target produced this round (accepted draft tokens + the next one). With
        them every asked speculator's whole draft is judged, sent or not (a draft the planner cut to
        nothing still learns from the one token every round emits); without, only the sent draft."""
        self.tell(prop, n_drafted, n_accepted, emitted)
        self.learn(prop, n_drafted, n_accepted, emitted)

    def tell(self, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray | None = None) -> None:
        """`accept`'s first half, due before the sequence's next draft: the speculators asked for it hear the
        verdict (Chain.accept; one may credit it to its last draft), and a draft tree's branches are judged
        (trees.judge reads what was last sent for the sequence)."""
        self.chain.accept(prop.seq_id, prop.asked, prop.speculator, n_drafted, n_accepted)
        if prop.tree is not None:
            self.trees.judge(prop, emitted)

    def learn(self, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray | None = None) -> None:
        """`accept`'s second half: the policy's own learning from the verdict (acceptance estimates,
        calibration, the look-up gate, model speculators' sent shares). It reads only `prop`, the verdict and
        state kept per speculator or per slot, never what a later draft replaces, so it may come a round late
        (overlapped rounds learn while the next round decodes), before the `forget_sequence` of the sequence's
        slot."""
        for name in prop.asked:
            winner = name == prop.speculator and n_drafted > 0
            if self.chain.is_model(name):
                self.models.steady.drafted(name, winner)
            if winner and len(prop.raw_probs) >= n_drafted:
                self.estimates.calibrate(name, prop.raw_probs[:n_drafted], n_accepted)
            m = n_accepted if winner else 0
            if emitted is not None:
                d = prop.drafts.get(name)
                m = 0
                if d is not None and len(d):
                    m = self.estimates.judged(name, prop.seq_id, d, emitted, prop.contexts.get(name, 0))
            elif winner:
                self.estimates.sent(name, prop.seq_id, n_drafted, n_accepted)
            # its draft's worth, sent or not (not the planner's cut), and whether the policy would ever send it
            self.gate.won(name, m, judged_worth(m, prop.worth.get(name), prop.rows_price.get(name)))

    def host_seconds(self, outside_decode: float) -> float:
        """A round's host work for `observe`: its wall time outside the target's decode less model speculators'
        drafting in it, which is priced as theirs. Taken once per round, right after it (the drafting seconds
        are counted from one call to the next)."""
        return max(0.0, outside_decode - self.models.take_seconds())

    def observe(self, batch_sizes: list[int], decode_seconds: float, cells: float | None, prefill: bool,
                n_decoding: int, n_draft_rows: int, host: float, n_emitted: int,
                rollback: RollbackStats | None) -> None:
        """A round's timing: the decode's (by batch size and context), the host's (`host_seconds`) and the
        target's rollbacks."""
        self.pricer.observe(batch_sizes, decode_seconds, cells, prefill, n_decoding, n_draft_rows, host, n_emitted)
        self.rollback_price.observe(rollback)

    # ---- sequence and chain life -----------------------------------------------------
    def forget_sequence(self, seq_id: int, names: tuple[str, ...]) -> None:
        """A slot that begins or ends: its shadows (tuning) guessed another sequence's tokens, the look-up gate
        probes the next sequence there as new traffic, and its per-sequence estimates are dropped."""
        if self.tuner is not None:
            self.tuner.forget(seq_id)
        self.gate.end(seq_id)
        self.estimates.end(seq_id, names)

    def chain_changed(self, change: ChainChange) -> None:
        """The chain was reconfigured: rebuilt and new speculators' estimates and look-up records start afresh
        (they measured the old parameters), and the tuner is rebuilt for the new chain."""
        for name in [*change.rebuilt, *change.built]:
            self.estimates.forget(name)
            self.gate.forget(name)
        self.tuner = self._make_tuner()

    def snapshot(self) -> dict:
        """What /v1/stats and the bench report of the policy (a copy: nothing here is live)."""
        gate = self.gate
        return {
            "speculator_ms_per_ask": {k: 1e3 * v / gate.asks[k] for k, v in gate.seconds.items() if gate.asks.get(k)},
            # rounds a speculator was not asked in: its winnings did not pay for its look-ups (lookup_gate.py)
            "lookups_skipped": dict(gate.skipped),
            "lookup_seconds": dict(gate.seconds),
            "lookups": dict(gate.asks),
            "host_cost": self.pricer.host.to_dict() | {"shape_change_penalty": self.cost.shape_change_penalty},
            "rollback_price": self.rollback_price.to_dict(),
            # the look-up parameters tuning chose, per speculator and sequence class (ChainConfig.tune)
            "tuning": self.tuner.to_dict() if self.tuner is not None else None,
            "estimates": self.estimates.snapshot(),
            "model_explore_budget_s": dict(self.models.explore_budget),
            "cost_table": self.cost.table(),
            "attention_ns_per_token_cell": self.cost.attn_seconds * 1e9,
            "tile_attention_ns_per_token_cell": self.cost.tile_attn_seconds * 1e9,
            "subtile_attention_ns_per_token_cell": self.cost.subtile_attn_seconds * 1e9,
            "trees": self.trees.snapshot(),
        }
