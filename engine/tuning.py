"""Online tuning of the speculators' own draft parameters (ik_llama.cpp's spec-tune, SGLang's adaptive
speculation): a bandit over a small grid per speculator, per sequence class.

Only parameters a speculator reads at each look-up are tuned (suffix's `min_match` / `p_min`, ngram_mod's
`n_min`, ngram_cache's `n_draft`, ngram_simple's `size_n` / `size_m`): one instance, with its shared tables
and trees, serves every setting, the setting being swapped in for the look-ups of the sequences that use it
(`Chain.propose`). Parameters that shape an index (ngram_mod's `n_match`, a trie's depth) and model
speculators' (held by the companion actor) are not tuned.

Reward, the cost model's own accounting, per sequence-round the speculator was asked in: the tokens its sent
draft gained (accepted tokens minus the tokens the round's plain rate would have made in the time the draft's
verify rows took), minus its look-up time in the same tokens. A setting that drafts nothing gains 0 and pays
its look-ups; one that drafts badly pays for rejected rows.

Choice, per round: the setting with the best mean gain (the configured one until another has shown better),
or, while the exploration budget allows, the least-known other setting (upper confidence bound). The budget
is a share of the sequence-rounds (`ChainConfig.tune_explore`, saved up and then spent, as `model_explore`
is), plus a start-up allowance of a few rounds per setting: exploring costs at most that share of the time
beyond the allowance. The allowance is paced (at most one choice in four) so that the settings are compared
on alike rounds, not each on the first rounds of the first sequences.

Gains drift: a speculator's tables grow, a sequence repeats itself more as it goes on, the traffic's mix
changes. So the records are discounted (each reward multiplies a bandit's records by DISCOUNT): a setting
judged long ago keeps its mean but loses its weight, stops being trusted, and its widening confidence bound
has it looked at again within the share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: the grid each speculator is tuned over when ChainConfig.tune_grids names none; the configured parameters
#: are always a setting too (the first), so tuning starts from them
DEFAULT_GRIDS: dict[str, list[dict[str, Any]]] = {
    "suffix": [{"min_match": m, "p_min": p} for m in (3, 6) for p in (0.05, 0.15, 0.4)],
    "ngram_mod": [{"n_min": n} for n in (1, 4, 16, 48)],
    "ngram_cache": [{"n_draft": n} for n in (2, 4, 8, 16)],
    "ngram_simple": [{"size_n": n, "size_m": m} for n in (3, 6, 12) for m in (8, 48)],
}

#: rounds of start-up allowance per setting: enough to see a few drafts of each
ALLOWANCE_PER_SETTING = 24
#: (discounted) rounds a setting needs before its mean is trusted over the configured one: about 8 recent ones
MIN_ROUNDS = 7.5
#: per reward, a bandit's records are multiplied by this: a result 500 sequence-rounds old weighs e^-1
DISCOUNT = 0.998
#: share of choices the start-up allowance may take (one in four: at 4 slots, one sequence a round)
ALLOWANCE_PACE = 0.25
#: the confidence bound's width (tokens per round): gains are ~0..n_max, mostly under 2
UCB_WIDTH = 1.0


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


def pick(rounds: list[float], gains: list[float], credits: float) -> tuple[int, bool]:
    """(setting, exploring) for one sequence-round. Exploit: the best mean among settings with MIN_ROUNDS
    (discounted) rounds (setting 0, the configured one, when none has). Explore, if `credits` >= 1: the other
    setting with the highest upper confidence bound (an untried one first).

    >>> pick([10, 10, 0], [5.0, 10.0, 0.0], credits=0)    # best mean: setting 1 (1.0 vs 0.5 a round)
    (1, False)
    >>> pick([10, 10, 0], [5.0, 10.0, 0.0], credits=1)    # untried setting 2 first
    (2, True)
    >>> pick([3, 0], [9.0, 0.0], credits=0)               # nothing trusted yet: the configured setting
    (0, False)
    """
    trusted = [i for i, n in enumerate(rounds) if n >= MIN_ROUNDS]
    best = max(trusted, key=lambda i: gains[i] / rounds[i]) if trusted else 0
    if credits < 1 or len(rounds) < 2:
        return best, False
    total = max(1.0, sum(rounds))

    def ucb(i: int) -> float:
        if rounds[i] <= 0:
            return math.inf
        return gains[i] / rounds[i] + UCB_WIDTH * math.sqrt(2 * math.log(total) / rounds[i])

    other = max((i for i in range(len(rounds)) if i != best), key=ucb)
    return (other, True) if ucb(other) > gains[best] / max(1, rounds[best]) else (best, False)


@dataclass
class Bandit:
    """One speculator's settings for one sequence class, and what each has gained (discounted records)."""

    settings: list[dict[str, Any]]
    explore: float
    rounds: list[float] = field(default_factory=list)  # discounted: the weight of each setting's record
    gains: list[float] = field(default_factory=list)  # discounted like `rounds`: gains / rounds is the mean
    counts: list[int] = field(default_factory=list)  # rounds each setting was used, all told (stats)
    credits: float = 0.0  # the exploration share, saved up
    allowance: float = 0.0  # the start-up allowance left
    pace: float = 1.0  # the allowance may be spent when this reaches 1 (at once, at the start)
    explored: int = 0

    def __post_init__(self) -> None:
        n = len(self.settings)
        self.rounds, self.gains, self.counts = [0.0] * n, [0.0] * n, [0] * n
        self.allowance = float(ALLOWANCE_PER_SETTING * (n - 1))

    def choose(self) -> int:
        self.credits += self.explore
        self.pace = min(1.0, self.pace + ALLOWANCE_PACE)
        paced = self.allowance if self.pace >= 1.0 else 0.0
        i, exploring = pick(self.rounds, self.gains, self.credits + paced)
        if exploring:
            self.explored += 1
            if paced >= 1.0:
                self.allowance -= 1
                self.pace = 0.0
            else:
                self.credits -= 1
        return i

    def reward(self, i: int, gain: float) -> None:
        self.rounds = [n * DISCOUNT for n in self.rounds]
        self.gains = [g * DISCOUNT for g in self.gains]
        self.rounds[i] += 1.0
        self.gains[i] += gain
        self.counts[i] += 1

    def best(self) -> int:
        return pick(self.rounds, self.gains, 0.0)[0]

    def to_dict(self, base: dict[str, Any]) -> dict:
        b = self.best()
        return {"choice": dict(base) | self.settings[b], "explored_rounds": self.explored,
                "settings": [{"params": dict(base) | s, "rounds": c, "recent_weight": round(n, 1),
                              "gain_per_round": round(g / n, 4) if n > 0 else None}
                             for s, c, n, g in zip(self.settings, self.counts, self.rounds, self.gains)]}


class ParamTuner:
    """The chain's bandits: per tuned speculator and sequence class. `base[name]`: its configured parameters;
    `grids[name]`: the points tuned over (DEFAULT_GRIDS where not given)."""

    def __init__(self, base: dict[str, dict[str, Any]], grids: dict[str, list[dict[str, Any]]],
                 explore: float) -> None:
        self.base = {k: dict(v) for k, v in base.items()}
        self.settings = {name: settings_of(self.base[name], grid) for name, grid in grids.items()}
        self.explore = explore
        self.bandits: dict[tuple[str, str], Bandit] = {}

    def tunes(self, name: str) -> bool:
        return len(self.settings.get(name, ())) > 1

    def choose(self, name: str, cls: str) -> tuple[int, dict[str, Any]]:
        """(setting index, its parameter overrides) for one sequence-round of `name` in class `cls`."""
        bandit = self.bandits.get((name, cls))
        if bandit is None:
            bandit = self.bandits[(name, cls)] = Bandit(self.settings[name], self.explore)
        i = bandit.choose()
        return i, self.settings[name][i]

    def reward(self, name: str, cls: str, i: int, gain: float) -> None:
        bandit = self.bandits.get((name, cls))
        if bandit is not None:
            bandit.reward(i, gain)

    def to_dict(self) -> dict:
        """/v1/stats `tuning`: per speculator and class, the current choice and each setting's record."""
        out: dict[str, dict] = {}
        for (name, cls), b in sorted(self.bandits.items()):
            out.setdefault(name, {})[cls] = b.to_dict(self.base[name])
        return out


def round_gain(n_drafted: int, n_accepted: int, time_in_tokens, lookup_tokens: float) -> float:
    """One sequence-round's gain, in tokens, for the speculator asked: its sent draft's accepted tokens less
    the tokens its verify rows cost (`time_in_tokens(n)`: Pricing.time_in_tokens), less its look-up time in
    tokens. A draft not sent (or none) gains nothing and still pays its look-up.

    >>> round_gain(4, 3, lambda n: [0.2, 0.4, 0.6, 0.8][:n], 0.05)   # 3 - 0.8 - 0.05
    2.15
    >>> round_gain(0, 0, lambda n: [], 0.05)
    -0.05
    """
    gain = -lookup_tokens
    if n_drafted > 0:
        t = time_in_tokens(n_drafted)
        gain += n_accepted - (float(t[n_drafted - 1]) if len(t) >= n_drafted else 0.0)
    return round(gain, 6)


def draft_tuned(spec, name: str, reqs: list, n_max: list[int], tuner: ParamTuner | None,
                ) -> tuple[list, list[int]]:
    """`spec.draft` for the chain's requests `reqs` (SeqDraftRequest, each drafting at most n_max[j] tokens),
    each with its setting: the request's own `params` for this speculator (not tuned), else the tuner's
    choice for its class (tune_class None: the configured parameters). Requests sharing a setting draft together; the configured parameters are put back
    afterwards. Returns (drafts in request order, setting index per request: -1 where not tuned)."""
    from .speculator import DraftRequest

    drafts_for = [DraftRequest(r.seq_id, r.history_for(spec), n) for r, n in zip(reqs, n_max)]
    if (tuner is None or not tuner.tunes(name)) and not any(r.params for r in reqs):
        return spec.draft(drafts_for), [-1] * len(reqs)  # the common case: no per-round work (host cost)
    groups: dict[tuple, list[int]] = {}
    setting = [-1] * len(reqs)
    over: list[dict] = []
    for j, r in enumerate(reqs):
        fix = (r.params or {}).get(name)
        if fix is None and tuner is not None and r.tune_class is not None and tuner.tunes(name):
            setting[j], o = tuner.choose(name, r.tune_class)
        else:
            o = fix or {}
        over.append(o)
        groups.setdefault(tuple(sorted(o.items())), []).append(j)
    if len(groups) == 1 and not over[0]:
        return spec.draft(drafts_for), setting
    out: list = [None] * len(reqs)
    configured = spec.params
    try:
        for key, members in groups.items():
            spec.params = configured.model_copy(update=dict(key)) if key else configured
            for j, d in zip(members, spec.draft([drafts_for[j] for j in members])):
                out[j] = d
    finally:
        spec.params = configured
    return out, setting


def reward_round(tuner: ParamTuner, pricing, prop, name: str, n_drafted: int, n_accepted: int) -> None:
    """The tuner's reward for the setting `name` drafted with for `prop`'s sequence (round_gain), priced with
    the round's own costs (`pricing`: chain.Pricing): seconds become the tokens the round's plain rate
    makes in them."""
    if pricing is None or prop.tune_class is None:
        return
    base = pricing.cost(pricing.base_tokens)
    rate = pricing.n_decoding / base if base > 0 else 0.0
    gain = round_gain(n_drafted, n_accepted, pricing.time_in_tokens, prop.lookup_s.get(name, 0.0) * rate)
    tuner.reward(name, prop.tune_class, prop.settings[name], gain)


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
