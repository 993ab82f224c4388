"""Online tuning of the speculators' own draft parameters (ik_llama.cpp's spec-tune, SGLang's adaptive
speculation): a bandit over a small grid per speculator, per sequence class.

Only parameters a speculator reads at each look-up are tuned (suffix's `min_match` / `p_min`, ngram_mod's
`n_min`, ngram_cache's `n_draft`, ngram_simple's `size_n` / `size_m`): one instance, with its shared tables
and trees, serves every setting, the setting being swapped in for the look-ups of the sequences that use it
(`Chain.look_up`'s settings). Parameters that shape an index (ngram_mod's `n_match`, a trie's depth) and model
speculators' (held by the companion actor) are not tuned.

Judging (engine/policy/tuning_shadow.py): now and then, every setting drafts for one sequence at the same point (a
shadow look-up); once the target has emitted the tokens that followed, each draft gets the reward the cost
model's own accounting gives it: the tokens of the prefix the cost policy would have sent that the target
kept, less those rows' verify time and the look-up's own time, in tokens of the round's plain rate. So the
settings are compared side by side on the same histories, and a bad setting's draft is never sent.

Choice, per round: the setting with the best mean gain, once it has been judged about 5 times (the configured
one until then). Exploring costs look-up time only: shadows are made while the time they took stays within a
share of the rounds' plain decode time (`ChainConfig.tune_explore`, saved up and then spent, as
`model_explore` is), after a start-up allowance of SHADOW_ALLOWANCE shadows per speculator and class (at
most one a round).

Gains drift: a speculator's tables grow, a sequence repeats itself more as it goes on, the traffic's mix
changes. So the records are discounted (each judgment multiplies a bandit's records by DISCOUNT): what was
judged long ago weighs less than what was judged lately.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tuning_shadow import MAX_WAITING, Shadow, ShadowLedger, send_length

#: the grid each speculator is tuned over when ChainConfig.tune_grids names none; the configured parameters
#: are always a setting too (the first), so tuning starts from them
DEFAULT_GRIDS: dict[str, list[dict[str, Any]]] = {
    "suffix": [{"min_match": m, "p_min": p} for m in (3, 6) for p in (0.05, 0.15, 0.4)],
    "ngram_mod": [{"n_min": n} for n in (1, 4, 16, 48)],
    "ngram_cache": [{"n_draft": n} for n in (2, 4, 8, 16)],
    "ngram_simple": [{"size_n": n, "size_m": m} for n in (3, 6, 12) for m in (8, 48)],
}

#: judgments (discounted) a setting needs before its mean is trusted over the configured one: about 5 recent ones
#: (they are paired: every setting judged on the same histories, so few tell them apart)
MIN_ROUNDS = 4.5
#: per judgment, a bandit's records are multiplied by this: a result 100 judgments old weighs e^-1
DISCOUNT = 0.99
#: shadows per speculator and class made before the time budget applies (one a round at most)
SHADOW_ALLOWANCE = 16
#: time (seconds) a speculator's shadow budget may save up: a few dozen shadows, so that rounds without one
#: (none to make, all waiting) do not buy a long run of them later
SHADOW_BUDGET_CAP = 0.02


def settings_of(base: dict[str, Any], grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The settings tuned over: the configured parameters first, then each grid point applied on top of them
    (duplicates dropped).

    >>> settings_of({"p_min": 0.9, "min_match": 16}, [{"p_min": 0.1}, {"p_min": 0.9}])
    [{}, {'p_min': 0.1}]
    """
    out: list[dict[str, Any]] = [{}]
    seen = [dict(base)]
    for point in grid:
        full = dict(base) | point
        if full not in seen:
            seen.append(full)
            out.append(dict(point))
    return out


def pick(rounds: list[float], gains: list[float]) -> int:
    """The setting to use: the best mean gain among settings with MIN_ROUNDS (discounted) judgments; setting 0,
    the configured one, while none has.

    >>> pick([10, 10, 0], [5.0, 10.0, 0.0])    # 1.0 a round against 0.5
    1
    >>> pick([3, 3], [9.0, 0.0])               # nothing trusted yet: the configured setting
    0
    """
    trusted = [i for i, n in enumerate(rounds) if n >= MIN_ROUNDS]
    return max(trusted, key=lambda i: gains[i] / rounds[i]) if trusted else 0


@dataclass
class Bandit:
    """One speculator's settings for one sequence class, and what each has gained (discounted records)."""

    settings: list[dict[str, Any]]
    rounds: list[float] = field(default_factory=list)  # discounted: the weight of each setting's record
    gains: list[float] = field(default_factory=list)  # discounted like `rounds`: gains / rounds is the mean
    counts: list[int] = field(default_factory=list)  # sequence-rounds each setting drafted for, all told (stats)
    allowance: int = SHADOW_ALLOWANCE  # shadows left before the time budget applies
    judged: int = 0  # shadows judged, all told

    def __post_init__(self) -> None:
        n = len(self.settings)
        self.rounds, self.gains, self.counts = [0.0] * n, [0.0] * n, [0] * n

    def choose(self) -> int:
        i = self.best()
        self.counts[i] += 1
        return i

    def record(self, gains: list[float]) -> None:
        """One shadow's judgment: what every setting would have gained on the same history."""
        self.rounds = [n * DISCOUNT + 1.0 for n in self.rounds]
        self.gains = [g * DISCOUNT + x for g, x in zip(self.gains, gains)]
        self.judged += 1

    def best(self) -> int:
        return pick(self.rounds, self.gains)

    def to_dict(self, base: dict[str, Any]) -> dict:
        return {"choice": dict(base) | self.settings[self.best()], "judged": self.judged,
                "settings": [{"params": dict(base) | s, "rounds": c, "recent_weight": round(n, 1),
                              "gain_per_round": round(g / n, 4) if n > 0 else None}
                             for s, c, n, g in zip(self.settings, self.counts, self.rounds, self.gains)]}


class ParamTuner:
    """The chain's bandits: per tuned speculator and sequence class. `base[name]`: its configured parameters;
    `grids[name]`: the points tuned over (DEFAULT_GRIDS where not given); `explore`: the share of the rounds'
    plain decode time shadow look-ups may take."""

    def __init__(self, base: dict[str, dict[str, Any]], grids: dict[str, list[dict[str, Any]]],
                 explore: float) -> None:
        self.base = {k: dict(v) for k, v in base.items()}
        self.settings = {name: settings_of(self.base[name], grid) for name, grid in grids.items()}
        self.explore = explore
        self.bandits: dict[tuple[str, str], Bandit] = {}
        self.ledger = ShadowLedger()
        self.budget: dict[str, float] = {}  # seconds of shadow look-ups saved up, per speculator
        self.shadow_s: dict[str, float] = {}  # what the speculator's last shadow took
        self.turn: dict[str, int] = {}  # rotates the sequence shadowed and the order its settings draft in
        self.shadow_total_s: dict[str, float] = {}  # all shadows' time, per speculator (stats)
        self._untaken_s = 0.0  # shadow time since take_seconds()

    def tunes(self, name: str) -> bool:
        return len(self.settings.get(name, ())) > 1

    def bandit(self, name: str, cls: str) -> Bandit:
        b = self.bandits.get((name, cls))
        if b is None:
            b = self.bandits[(name, cls)] = Bandit(self.settings[name])
        return b

    def choose(self, name: str, cls: str) -> tuple[int, dict[str, Any]]:
        """(setting index, its parameter overrides) for one sequence-round of `name` in class `cls`."""
        i = self.bandit(name, cls).choose()
        return i, self.settings[name][i]

    def judge_due(self, name: str, reqs: list) -> None:
        """Judge the shadows of `reqs`' sequences whose histories now reach past every draft."""
        for r in reqs:
            for cls, gains in self.ledger.due(name, r.seq_id, r.history):
                self.bandit(name, cls).record(gains)

    def to_shadow(self, name: str, reqs: list, plain_seconds: float) -> int | None:
        """The request (index) whose sequence gets a shadow this round, if any: one a round, in turn among the
        tuned sequences with the fewest waiting (at most MAX_WAITING), while the class's allowance lasts or the speculator's saved-up share
        of `plain_seconds` (the round's plain decode time) covers what its last shadow took."""
        budget = self.budget[name] = min(SHADOW_BUDGET_CAP, self.budget.get(name, 0.0) + self.explore * plain_seconds)
        cands = [j for j, r in enumerate(reqs)
                 if r.tune_class is not None and self.ledger.waiting(name, r.seq_id) < MAX_WAITING]
        if not cands:
            return None
        fewest = min(self.ledger.waiting(name, reqs[j].seq_id) for j in cands)
        cands = [j for j in cands if self.ledger.waiting(name, reqs[j].seq_id) == fewest]
        t = self.turn[name] = self.turn.get(name, -1) + 1
        j = cands[t % len(cands)]
        if self.bandit(name, reqs[j].tune_class).allowance > 0 or budget >= self.shadow_s.get(name, 0.0):
            return j
        return None

    def spent(self, name: str, cls: str, seconds: float) -> None:
        """A shadow was made: paid from the class's allowance while it lasts, else from the time budget."""
        self.shadow_s[name] = seconds
        self.shadow_total_s[name] = self.shadow_total_s.get(name, 0.0) + seconds
        self._untaken_s += seconds
        b = self.bandit(name, cls)
        if b.allowance > 0:
            b.allowance -= 1
        else:
            self.budget[name] -= seconds

    def forget(self, seq_id: int) -> None:
        self.ledger.forget(seq_id)

    def take_seconds(self) -> float:
        """Shadow time since the last call (then 0): the chain keeps it out of what the look-ups cost."""
        s, self._untaken_s = self._untaken_s, 0.0
        return s

    def to_dict(self) -> dict:
        """/v1/stats `tuning`: per speculator and class, the current choice and each setting's record."""
        out: dict[str, dict] = {}
        for (name, cls), b in sorted(self.bandits.items()):
            out.setdefault(name, {})[cls] = b.to_dict(self.base[name]) | {
                "shadow_seconds": round(self.shadow_total_s.get(name, 0.0), 4)}
        return out


def tuned_look_up(chain, name: str, reqs: list, n_max: list[int], tuner: ParamTuner | None, pricing=None,
                  estimate=None) -> list:
    """`chain.look_up` of `name` for `reqs` (SeqDraftRequest, each drafting at most n_max[j] tokens), each with
    the tuner's choice of setting for its class (tune_class None, or no tuner: the configured parameters).
    With `pricing` (pricing.Pricing) and `estimate(seq_id, length)` (the speculator's calibrated prefix
    probabilities for its last draft), the tuner first judges the shadows now due and may make one (`shadow`).
    Returns the drafts in request order."""
    spec = chain.speculator(name)
    asks = [(r.seq_id, r.history_for(spec), n) for r, n in zip(reqs, n_max)]
    if tuner is None or not tuner.tunes(name):
        return chain.look_up(name, asks)  # the common case: no per-round work (host cost)
    if pricing is not None and estimate is not None:
        tuner.judge_due(name, reqs)
        j = tuner.to_shadow(name, reqs, pricing.cost(pricing.base_tokens))
        if j is not None:  # before the real look-ups: what a speculator keeps of its last draft is theirs
            shadow(chain, name, tuner, reqs[j], asks[j], pricing, estimate)
    settings = [tuner.choose(name, r.tune_class)[1] if r.tune_class is not None else {} for r in reqs]
    return chain.look_up(name, asks, settings)


def shadow(chain, name: str, tuner: ParamTuner, req, ask: tuple, pricing, estimate) -> None:
    """Draft for one sequence with every setting of `name` (engine/policy/tuning_shadow.py), in an order that
    turns round by round (a look-up's first call of a round may do the speculator's shared work), and leave
    the drafts to be judged. The speculator's counters do not count them: they were never offered."""
    settings = tuner.settings[name]
    n = len(settings)
    first = tuner.turn.get(name, 0) % n
    base = pricing.cost(pricing.base_tokens)
    rate = pricing.n_decoding / base if base > 0 else 0.0
    time_tokens = pricing.time_in_tokens(max(1, ask[2]))
    drafts: list = [None] * n
    sends, lookups = [0] * n, [0.0] * n
    t_all = time.perf_counter()
    for i in [(first + k) % n for k in range(n)]:
        d, seconds = chain.shadow_look_up(name, ask, settings[i])
        drafts[i], lookups[i] = d, seconds * rate
        if len(d):  # estimated right after its own look-up: the estimate reads the draft's context
            sends[i] = send_length(estimate(req.seq_id, len(d)), time_tokens)
    tuner.spent(name, req.tune_class, time.perf_counter() - t_all)
    tuner.ledger.add(name, req.seq_id, Shadow(req.tune_class, len(ask[1]), drafts, sends,
                                              np.asarray(time_tokens), lookups))


def make_tuner(config, instances: dict, is_model) -> ParamTuner | None:
    """The chain's tuner (None: ChainConfig.tune off, or nothing to tune): every model-free speculator of the
    chain that has a grid, each grid point checked against its parameters (ValueError naming the bad one)."""
    if not config.tune:
        return None
    grids: dict[str, list[dict[str, Any]]] = {}
    for name in dict.fromkeys(config.speculators):
        spec = instances.get(name)
        grid = config.tune_grids.get(name, DEFAULT_GRIDS.get(name))
        if spec is None or is_model(spec) or not grid:
            continue
        cls, base = type(spec.params), spec.params.model_dump()
        for point in grid:
            unknown = sorted(set(point) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"tune_grids[{name!r}]: {point} names no parameter of {name}: {unknown}")
            try:
                cls.model_validate(base | point)
            except ValueError as e:
                raise ValueError(f"tune_grids[{name!r}]: {point} is not valid for {name}: {e}") from None
        grids[name] = grid
    if not grids:
        return None
    return ParamTuner({n: instances[n].params.model_dump() for n in grids}, grids, config.tune_explore)
