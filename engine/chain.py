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

Live reconfiguration (`Chain.reconfigure`, e.g. an arm's `user_config` on a
running replica): speculators whose parameters changed are rebuilt with the
new ones; their counters carry over (so metrics and /v1/stats stay
monotonic) and their acceptance estimates start afresh. Running sequences on
a rebuilt speculator go on with the new instance, begun on their history so
far (prompt + generated); output stays lossless either way, since every draft
is verified. New requests use the new chain at once; queued ones keep the
speculator names they were admitted with. Model speculators (`draft`, ...)
hold a model context: their parameters are start-up config and cannot change.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .acceptance import AcceptanceTracker, judge
from .calibration import PrefixCalibration
from .catchup_price import SteadyShare, catchup_charge
from .config import ChainConfig
from .lookup_gate import LookupGate
from .planner import plan_draft_lengths
from .speculator import EMPTY_DRAFT, Speculator, SpeculatorStats
from .speculators.draft_base import ModelSpeculator
from .tuning import draft_tuned, make_tuner

log = logging.getLogger("specray.chain")


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

    def cut(self, n: int) -> None:
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
    params: dict[str, dict] | None = None  # its own look-up parameters per speculator (not tuned)
    kv_history: np.ndarray | None = None  # after a context shift: the tokens by KV position (+ the last one)

    def history_for(self, spec: Speculator) -> np.ndarray:
        """What `spec` drafts from: model speculators mirror the target's KV by position, so after a context
        shift they get the shifted tokens (context_shift.py); model-free ones the whole history."""
        return self.kv_history if self.kv_history is not None and isinstance(spec, ModelSpeculator) else self.history


@dataclass
class Pricing:
    """What a round costs, for pricing model drafts before they are made (cost policy)."""

    cost: Callable[[int], float]  # seconds of a target decode of n tokens
    base_tokens: int  # tokens the round's target batch holds without drafts
    n_decoding: int  # sequences that emit a token this round anyway
    # share of the round time a model speculator may spend on drafts the price rules out (1 token, catch-up
    # included), so its acceptance keeps being measured (ChainConfig.model_explore); saved up, then spent
    explore: float = 0.0
    _seconds_per_token: float | None = field(default=None, init=False, repr=False)
    _time_list: list[float] = field(default_factory=list, init=False, repr=False)

    def seconds_per_token(self) -> float:
        """The round's plain decode time per sequence that emits a token (what a token is worth, in seconds;
        memoised: the look-up gate asks for it once per speculator, every round)."""
        if self._seconds_per_token is None:
            self._seconds_per_token = self.cost(self.base_tokens) / max(1, self.n_decoding)
        return self._seconds_per_token

    def time_in_tokens(self, n: int) -> np.ndarray:
        """[k-1]: tokens the round's plain rate would emit in the time k more verify rows take, k = 1..n
        (memoised: every draft of the round is priced with the same curve). Empty if the round is free."""
        return np.array(self.time_in_tokens_list(n), dtype=np.float64)

    def time_in_tokens_list(self, n: int) -> list[float]:
        """time_in_tokens(n) as Python floats, memoised for the round (empty if the round is free). Python, not
        numpy: a new Pricing every round computes it for its first draft, where numpy's per-call overhead outweighs
        the arithmetic."""
        if len(self._time_list) < n:
            base = self.cost(self.base_tokens)
            if base <= 0:
                return []
            per = self.n_decoding / base
            self._time_list = [(self.cost(self.base_tokens + k) - base) * per for k in range(1, n + 1)]
        return self._time_list[:n]


@dataclass
class ChainChange:
    """What `Chain.reconfigure` did."""

    rebuilt: list[str]  # instances replaced because their parameters changed (counters carried over)
    built: list[str]  # instances that did not exist before (named by the new chain for the first time)
    resumed: int  # running sequences whose speculators were begun anew on their history


def _blame(e: Exception, name: str) -> None:
    """Tag an exception raised while `name` works with `.speculator = name`, so whoever catches it (the
    scheduler) can disable that speculator instead of losing every draft of every round to it. The innermost
    tag wins: a nested call knows better which speculator failed. (Called from `except` clauses: a `try`
    costs nothing until it raises, where a context manager's enter and exit ran for every speculator, every
    round.)"""
    if getattr(e, "speculator", None) is None:
        e.speculator = name
        e.add_note(f"(raised by speculator {name!r})")


#: a speculator's own context buckets (Speculator.draft_context) kept apart by the acceptance estimate;
#: each is split 3 ways by agreement with the other speculators' drafts
CONTEXT_OWN_BUCKETS = 4

#: exploring time a model speculator may save up (seconds): enough for a long prompt's catch-up
EXPLORE_BUDGET_CAP = 2.0


def draft_value(prefix_probs: np.ndarray, pricing: Pricing | None) -> float:
    """What a draft is worth to its sequence, in tokens: expected accepted tokens of its best prefix minus
    the tokens the round's extra verify time would have produced at the round's plain rate. Without
    pricing, expected accepted tokens of the whole draft. The cost policy picks the draft worth most,
    so a long draft of shaky tokens does not beat a short sure one.

    >>> pp = np.array([0.9, 0.8, 0.3])
    >>> round(draft_value(pp, None), 2)
    2.0
    >>> flat = Pricing(cost=lambda n: 0.010 + 0.005 * (n - 1), base_tokens=1, n_decoding=1)
    >>> round(draft_value(pp, flat), 2)   # 2 tokens: 1.7 expected - 2 x 0.5 tokens of time
    0.7
    """
    n = len(prefix_probs)
    if n == 0:
        return 0.0
    # numpy's cumsum and max in Python floats (bitwise the same): 1-8 tokens, every draft scored, every round
    probs = prefix_probs.tolist() if isinstance(prefix_probs, np.ndarray) else [float(p) for p in prefix_probs]
    time = pricing.time_in_tokens_list(n) if pricing is not None else ()
    gain, best = 0.0, -math.inf
    for j, p in enumerate(probs):
        gain += p
        if time:
            best = max(best, gain - time[j])
    return gain if not time else max(0.0, best)


def judged_worth(m: int, worth: float | None, rows_price: np.ndarray | None) -> bool:
    """Whether a draft whose first `m` tokens were right counts as winning them for the look-up gate
    (lookup_gate.py). A probe's (rows_price: the time of 1..k verify rows, in tokens) in hindsight: its m
    right tokens beat their rows' time. Any other: the cost policy found a prefix worth sending (worth > 0), or
    did not price it (None).

    >>> judged_worth(3, 0.0, np.array([0.2, 0.4, 0.6]))   # a probe: 3 right tokens for 0.6 tokens of time
    True
    >>> judged_worth(1, 0.0, np.array([1.0, 2.0])), judged_worth(0, 0.0, np.array([0.1]))   # a whole decode a row
    (False, False)
    >>> judged_worth(2, 0.0, None), judged_worth(2, 0.4, None), judged_worth(2, None, None)
    (False, True, True)
    """
    if rows_price is not None:
        return m > 0 and (len(rows_price) == 0 or bool(m > rows_price[min(m, len(rows_price)) - 1]))
    return worth is None or worth > 0


def score_drafts(chain: "Chain", props: list[Proposal], unscored: list[tuple[int, str]], best_score: list[float],
                 policy: str, pricing: Pricing | None) -> None:
    """Score the drafts in `unscored` (then empty it), keeping each sequence's best. A draft's context
    for the acceptance estimate is its speculator's own bucket and whether another speculator's draft
    for the sequence starts with the same token (agree), another token (disagree) or there is none:
    two speculators that agree are right more often than either alone, and when they disagree at
    most one of them is."""
    for i, name in unscored:
        p = props[i]
        d = p.drafts[name]
        others = [o for n, o in p.drafts.items() if n != name]
        agree = 0 if not others else (1 if any(o[0] == d[0] for o in others) else 2)
        p.contexts[name] = min(p.contexts[name], CONTEXT_OWN_BUCKETS - 1) * 3 + agree
        try:  # called from a model speculator's turn too: blame the draft's own speculator
            raw, pp = chain.estimate(name, p.seq_id, len(d), p.contexts[name])
            score = (chain.trackers[name].rate(p.seq_id) * len(d) if policy == "expected"
                     else draft_value(pp, pricing))
        except Exception as e:
            _blame(e, name)
            raise
        if pricing is not None and policy == "cost":
            p.worth[name] = score
            if name in chain.gate.probing:
                p.rows_price[name] = pricing.time_in_tokens(len(d))
        if score > best_score[i]:
            best_score[i] = score
            p.speculator, p.tokens, p.prefix_probs, p.raw_probs = name, d, pp, raw
    unscored.clear()


class Chain:
    def __init__(self, config: ChainConfig, factory: Callable[[str, dict | None], Speculator]) -> None:
        self.config = config
        self._factory = factory
        self.instances: dict[str, Speculator] = {}
        self._needs_hidden: dict[tuple[str, ...], bool] = {}  # needs_hidden's answers
        self.trackers: dict[str, AcceptanceTracker] = {}
        self.calibrations: dict[str, PrefixCalibration] = {}  # per speculator: its tracker's bias by position
        self.explore_budget: dict[str, float] = {}  # model speculator -> seconds it may spend exploring
        # each speculator's look-ups: their host time, and whether its winnings pay for them (cost policy)
        self.gate = LookupGate()
        for name in config.speculators:
            self.speculator(name)  # fail fast on unknown names / bad params
        self.tuner = make_tuner(config, self.instances, lambda s: isinstance(s, ModelSpeculator))
        self._model_seconds = 0.0  # model speculators' draft time since take_model_seconds() (scheduler.host_seconds)
        self.steady = SteadyShare()  # per model speculator: the share of its drafts sent (catchup_price.py)

    def speculator(self, name: str) -> Speculator:
        spec = self.instances.get(name)
        if spec is None:
            spec = self._install(name, *self._build(name, self.config.params.get(name)))
        return spec

    def _build(self, name: str, params: dict | None) -> tuple[Speculator, AcceptanceTracker, PrefixCalibration]:
        """A new instance of `name` and the estimate state every instance needs: the one place they are made,
        so no instance can exist without its tracker and calibration (propose would fail on it every round)."""
        return self._factory(name, params), AcceptanceTracker(n_contexts=3 * CONTEXT_OWN_BUCKETS), PrefixCalibration()

    def _install(self, name: str, spec: Speculator, tracker: AcceptanceTracker,
                 calibration: PrefixCalibration) -> Speculator:
        self.instances[name] = spec
        self._needs_hidden.clear()  # a new instance may read hidden rows where the old one did not
        self.gate.forget(name)  # a new instance's look-ups and winnings are its own
        self.trackers[name] = tracker
        self.calibrations[name] = calibration
        return spec

    def reconfigure(self, new: ChainConfig,
                    running: Mapping[int, tuple[tuple[str, ...], np.ndarray]] | None = None) -> ChainChange:
        """Swap the chain's config for `new` while sequences run (between rounds only: no proposal may be in
        flight). running: seq_id -> (speculator names, history so far) of every running sequence; a rebuilt
        or new speculator a sequence names is begun on its history, so the sequence goes on drafting with it.

        Speculators whose parameters changed are rebuilt, keeping their counters; their estimates (tracker,
        calibration) start afresh, since they measured the old parameters. Speculators the new chain names
        for the first time are built. Speculators left out of the new chain are kept: queued and running
        sequences (and per-request chains) may still name them. Raises ValueError, changing nothing, for
        unknown speculators, bad parameters or a model speculator whose parameters changed."""
        changed = sorted(n for n in self.instances
                         if (self.config.params.get(n) or {}) != (new.params.get(n) or {}))
        models = [n for n in changed if isinstance(self.instances[n], ModelSpeculator)]
        if models:
            raise ValueError(f"parameters of model speculators {models} cannot change at run time (restart the "
                             "deployment)")
        added = [n for n in dict.fromkeys(new.speculators) if n not in self.instances]
        # everything is built and begun before anything is installed: a bad name, parameter or begin leaves
        # the running chain untouched
        try:
            fresh = {name: self._build(name, new.params.get(name)) for name in changed + added}
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"chain update refused: {e}") from None
        begun = _begin_on_running({n: f[0] for n, f in fresh.items()}, running or {})
        for name, seq_id in begun:
            if name in self.instances:
                _end_quietly(self.instances[name], name, seq_id)  # discarded, but may hold per-sequence state
        for name, (spec, tracker, calibration) in fresh.items():
            old = self.instances.get(name)
            if old is not None:  # counters carry over, the same object: whoever holds it sees them go on
                old.stats.merge(spec.stats)
                spec.stats = old.stats
            self._install(name, spec, tracker, calibration)
        self.config = new
        self.tuner = make_tuner(new, self.instances, lambda s: isinstance(s, ModelSpeculator))
        return ChainChange(rebuilt=changed, built=added, resumed=len({seq_id for _, seq_id in begun}))

    def validate(self, names: tuple[str, ...]) -> None:
        for name in names:
            self.speculator(name)

    # ---- sequence life -----------------------------------------------------------
    def begin(self, seq_id: int, names: tuple[str, ...], prompt: np.ndarray, grammar: str | None = None) -> None:
        _new_sequence(self, seq_id)
        for name in names:  # `grammar`: the request's, for the speculators that read it (set_grammar)
            if hasattr(spec := self.speculator(name), "set_grammar"):
                spec.set_grammar(seq_id, grammar)
            spec.begin(seq_id, prompt)

    def end(self, seq_id: int, names: tuple[str, ...]) -> None:
        _new_sequence(self, seq_id)
        for name in names:
            self.instances[name].end(seq_id)
            self.trackers[name].end(seq_id)

    def process(self, seq_id: int, names: tuple[str, ...], tokens: np.ndarray, pos: int) -> None:
        """The target committed `tokens` at positions pos... of seq_id (mirrored by model speculators)."""
        for name in names:
            self.instances[name].process(seq_id, tokens, pos)

    # ---- hidden rows (mtp, eagle3: speculators with a `take_hidden` method) ----------------------------
    def needs_hidden(self, names: tuple[str, ...]) -> bool:
        """True if a speculator of `names` reads the target's hidden rows (the target then returns them).
        Memoised per chain (asked for every decoding sequence, every round); _install clears it."""
        hit = self._needs_hidden.get(names)
        if hit is None:
            hit = self._needs_hidden[names] = any(hasattr(self.instances.get(n), "take_hidden") for n in names)
        return hit

    def hidden(self, record) -> None:
        """A round's hidden rows (engine/hidden_rows.py HiddenRows, or a transport handle) for every speculator
        that reads them; they pair them with the process() calls that follow."""
        for spec in self.instances.values():
            take = getattr(spec, "take_hidden", None)
            if take is not None:
                take(record)

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
        unscored: list[tuple[int, str]] = []  # drafts to score once every free speculator has drafted
        spt = None if pricing is None else pricing.seconds_per_token()
        for name in names_in_order:
            try:  # a failure is the speculator's: the scheduler disables it
                idx = [i for i in pending if name in requests[i].chain]
                if policy == "first":
                    idx = [i for i in idx if props[i].speculator is None]
                spec = self.instances[name]
                if idx and pricing is not None and not isinstance(spec, ModelSpeculator):  # gated: probes only
                    idx = self.gate.ask(name, idx, [requests[i].seq_id for i in idx], spt)
                if not idx:
                    continue
                n_max = {i: requests[i].n_max for i in idx}
                exploring = False
                if policy == "cost" and pricing is not None and isinstance(spec, ModelSpeculator):
                    score_drafts(self, props, unscored, best_score, policy, pricing)
                    n_max, exploring = price_model_drafts(self, name, spec, idx, requests, best_score, pricing)
                    idx = [i for i in idx if i in n_max]
                    if not idx:
                        continue
                t0 = time.perf_counter()
                estimate = None if self.tuner is None else _shadow_estimate(self, name, spec)
                drafts = draft_tuned(spec, name, [requests[i] for i in idx], [n_max[i] for i in idx], self.tuner,
                                     pricing, estimate)
                dt = time.perf_counter() - t0
                if self.tuner is not None:  # shadow look-ups (tuning) are the tuner's cost, not the look-ups'
                    dt -= self.tuner.take_seconds()
                self.gate.asked(name, len(idx), dt)
                if isinstance(spec, ModelSpeculator):
                    self._model_seconds += dt
                if exploring:  # an exploring draft is charged what it took, not what it was priced at
                    self.explore_budget[name] -= dt
                for i, d in zip(idx, drafts):
                    props[i].asked += (name,)
                    if len(d) == 0:
                        continue
                    props[i].drafts[name] = d
                    props[i].contexts[name] = spec.draft_context(requests[i].seq_id)
                    if policy == "first":
                        if props[i].speculator is None:
                            props[i].speculator, props[i].tokens = name, d
                            props[i].raw_probs, props[i].prefix_probs = self.estimate(
                                name, props[i].seq_id, len(d), props[i].contexts[name])
                        continue
                    unscored.append((i, name))
            except Exception as e:
                _blame(e, name)
                raise
        score_drafts(self, props, unscored, best_score, policy, pricing)
        return props

    def take_model_seconds(self) -> float:
        """Seconds model speculators drafted since the last call (then 0): priced as theirs
        (price_model_drafts), not the host's."""
        s, self._model_seconds = self._model_seconds, 0.0
        return s

    def estimate(self, name: str, seq_id: int, length: int, context: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(raw, calibrated) P(first j+1 tokens of name's next draft for seq_id all accepted), j < length."""
        raw = self.trackers[name].prefix_probs(seq_id, length, context)
        return raw, self.calibrations[name].apply(raw)

    def accept(self, prop: Proposal, n_drafted: int, n_accepted: int, emitted: np.ndarray | None = None) -> None:
        """Tell every speculator asked for this sequence how its round went.

        emitted: the tokens the target produced this round (accepted draft tokens + the next one). With
        them every asked speculator's whole draft is judged, sent or not (a draft the planner cut to
        nothing still learns from the one token every round emits); without, only the sent draft.
        """
        for name in prop.asked:
            winner = name == prop.speculator and n_drafted > 0
            self.instances[name].accept(prop.seq_id, n_drafted, n_accepted, winner)
            if isinstance(self.instances[name], ModelSpeculator):
                self.steady.drafted(name, winner)
            if winner and len(prop.raw_probs) >= n_drafted:
                self.calibrations[name].update(prop.raw_probs[:n_drafted], n_accepted)
            tracker, m = self.trackers[name], n_accepted if winner else 0
            if emitted is not None:
                d = prop.drafts.get(name)
                m = 0
                if d is not None and len(d):
                    m, censored = judge(d, emitted)
                    tracker.update(prop.seq_id, len(d), m, censored, prop.contexts.get(name, 0))
            elif winner:
                tracker.update(prop.seq_id, n_drafted, n_accepted)
            # its draft's worth, sent or not (not the planner's cut), and whether the policy would ever send it
            self.gate.won(name, m, judged_worth(m, prop.worth.get(name), prop.rows_price.get(name)))

    def stats(self) -> dict[str, SpeculatorStats]:
        return {name: spec.stats for name, spec in self.instances.items()}


def price_model_drafts(
    chain: "Chain", name: str, spec: ModelSpeculator, idx: list[int], requests: list[SeqDraftRequest],
    best_score: list[float], pricing: Pricing,
) -> tuple[dict[int, int], bool]:
    """Which sequences a model speculator drafts for this round, and how many tokens each: only where
    its expected accepted tokens beat the best free draft, and the planner finds the draft time worth
    paying: the draft steps (shared among the sequences drafting together) plus, per sequence, the
    catch-up of a draft cache that lags (up to its whole prompt), spread over the rounds the speculator is
    expected to keep drafting for it (catchup_price.py).

    Returns ({request index: n_max}, exploring): exploring is True when the only draft chosen is the 1-token
    one that keeps measuring the model's acceptance; the caller then charges its draft time, as measured,
    to chain.explore_budget."""
    cands: list[int] = []
    probs: list[np.ndarray] = []
    for i in idx:
        _, pp = chain.estimate(name, requests[i].seq_id, min(requests[i].n_max, spec.max_steps))
        if len(pp) and draft_value(pp, pricing) > best_score[i]:
            cands.append(i)
            probs.append(pp)
    if not cands:
        return {}, False
    share = spec.draft_seconds(len(cands), max(len(p) for p in probs)) / len(cands)
    catchup = [spec.catchup_seconds(requests[i].seq_id, requests[i].history_for(spec)) for i in cands]
    extra = []
    for i, pp, c in zip(cands, probs, catchup):
        extra.append(share + catchup_charge(c, requests[i].tokens_left, float(pp.sum()), chain.steady.share(name)))
    lengths = plan_draft_lengths(probs, pricing.base_tokens, pricing.cost, n_decoding=pricing.n_decoding,
                                 extra_seconds=extra)
    # a draft cut this short must still beat the free one, or its time is wasted
    chosen = {i: k for i, k, pp in zip(cands, lengths, probs)
              if k > 0 and draft_value(pp[:k], pricing) > best_score[i]}
    exploring = False
    if not chosen and pricing.explore > 0:
        # keep measuring the model's acceptance, within a time budget: each round saves `explore` x its
        # plain decode time; a 1-token draft (the cheapest catch-up of the candidates, the draft step and
        # its verify row) is made once the savings cover it. Exploring thus costs at most that share of
        # the time, however long the catch-up (a whole prompt for a sequence never drafted)
        base = pricing.cost(pricing.base_tokens)
        budget = min(EXPLORE_BUDGET_CAP, chain.explore_budget.get(name, 0.0) + pricing.explore * base)
        j = min(range(len(cands)), key=lambda c: catchup[c])
        price = catchup[j] + spec.draft_seconds(1, 1) + pricing.cost(pricing.base_tokens + 1) - base
        if price <= budget:
            chosen = {cands[j]: 1}
            budget -= pricing.cost(pricing.base_tokens + 1) - base  # the verify row; propose() charges the rest
            exploring = True
        chain.explore_budget[name] = budget
    return chosen, exploring



def _shadow_estimate(chain: Chain, name: str, spec: Speculator) -> Callable[[int, int], np.ndarray]:
    """The calibrated acceptance estimate of a shadow look-up's draft (tuning): (seq_id, length) -> prefix probs,
    in the speculator's own context bucket (a shadow has no other speculators' drafts to agree with)."""
    return lambda sid, n: chain.estimate(name, sid, n, min(spec.draft_context(sid), CONTEXT_OWN_BUCKETS - 1) * 3)[1]


def _new_sequence(chain: Chain, seq_id: int) -> None:
    """A slot that begins or ends: its shadows (tuning) guessed another sequence's tokens, and the look-up gate
    probes the next sequence there as new traffic."""
    if chain.tuner is not None:
        chain.tuner.forget(seq_id)
    chain.gate.end(seq_id)


def _begin_on_running(specs: Mapping[str, Speculator],
                      running: Mapping[int, tuple[tuple[str, ...], np.ndarray]]) -> list[tuple[str, int]]:
    """Begin each of `specs` on every running sequence that names it, on its history so far; returns the
    (name, seq_id) pairs begun. If one fails, those begun are ended again and ValueError is raised."""
    begun: list[tuple[str, int]] = []
    for seq_id, (names, history) in running.items():
        for name in names:
            if name not in specs:
                continue
            try:
                specs[name].begin(seq_id, np.array(history, dtype=np.int32))
            except Exception as e:
                for b_name, b_seq in begun:
                    _end_quietly(specs[b_name], b_name, b_seq)
                raise ValueError(f"chain update refused: speculator {name!r} could not resume sequence "
                                 f"{seq_id}: {type(e).__name__}: {e}") from e
            begun.append((name, seq_id))
    return begun


def _end_quietly(spec: Speculator, name: str, seq_id: int) -> None:
    """End an instance being dropped: a failure there must not stop what dropping it is for."""
    try:
        spec.end(seq_id)
    except Exception:
        log.warning("ending dropped speculator %s on sequence %s failed", name, seq_id, exc_info=True)
