"""When a speculator's look-up costs more than its drafts win: ask it only now and then.

Every speculator of a chain is asked for a draft every round, and each look-up
costs host time (0.03-0.05 ms for the n-gram and suffix speculators here),
whether or not its draft is the one sent. A speculator whose drafts seldom win
(another speculator of the chain drafts the same or better) pays that on every
token for nothing; on a GPU, where a round of a small model takes 1-2 ms,
three such look-ups are 5-10% of the round. So each speculator's winnings are
followed: the tokens its draft gets right per look-up (judged against what the
target emitted, sent or not, so the gate does not follow the planner's cuts;
an exponential average), worth the round's time per token each. A draft the
cost policy finds worth nothing (no prefix of it pays its verify time at its
estimated acceptance: chain.draft_value) wins nothing, however right it turns
out: at that price it is never sent, so its look-up bought nothing (measured
at 4 slots on SmolLM2, writing prompts: the chain's look-ups cost 0.66 ms a
round while one draft token in 256 rounds was sent; right-but-unsendable
drafts had kept them all asked). That rule waits until `learn` of the
speculator's drafts have been judged, because its acceptance estimate starts
from a prior: one that starts low would find every draft worthless and be
gated. A probe is judged in hindsight instead (chain.judged_worth: did the
tokens it got right beat the time of their verify rows?): a gated speculator's
acceptance estimate learns only on probes, so a probe judged by that estimate
could never see the traffic change (a copy task after chat); once a probe
reopens the gate the estimate learns from every round again. Once it has been
asked `warmup` times and its winnings are worth less than its look-up, it is
asked only now and then (so a change in the traffic is still seen): one gated
round in `probe_every`, then, while probes find it still not paying, the wait
doubles up to `max_probe_every` (at 8 slots under an H100-like decode, probes
every 8th round still cost 0.3 ms a round of look-ups that paid nothing); a
speculator found paying again starts over at `probe_every`. Drafts never
change what is emitted, so this is lossless.

>>> g = LookupGate(warmup=4, probe_every=4, max_probe_every=8)
>>> for _ in range(8):
...     g.asked("ngram_mod", 1, 0.00004)   # 0.04 ms a look-up
...     g.won("ngram_mod", 0)              # its drafts are never right
>>> "".join(".P"[not g.skip("ngram_mod", 0.002)] for _ in range(20))   # 2 ms a token: P = probed
'...P.......P.......P'
>>> g.skip("suffix", 0.002)   # not seen yet
False
"""

from __future__ import annotations


class LookupGate:
    def __init__(self, warmup: int = 64, probe_every: int = 8, ema: float = 0.02, learn: int = 64,
                 max_probe_every: int = 64) -> None:
        self.warmup, self.probe_every, self.ema, self.learn = warmup, probe_every, ema, learn
        self.max_probe_every = max(probe_every, max_probe_every)
        self._wait: dict[str, int] = {}  # gated rounds between its probes now (probe_every, doubling)
        self.probing: set[str] = set()  # asked this round as a probe (its drafts judged in hindsight: Chain)
        self.judged: dict[str, int] = {}  # drafts of each speculator judged so far (the worth rule's wait)
        self.asks: dict[str, int] = {}  # sequences each speculator was asked for
        self.seconds: dict[str, float] = {}  # its look-up time, summed
        self._value: dict[str, float] = {}  # accepted tokens of its sent drafts per look-up, averaged
        self._rounds: dict[str, int] = {}  # rounds it was gated in since its last probe
        self.skipped: dict[str, int] = {}  # rounds it was not asked in (stats)

    def asked(self, name: str, n_sequences: int, seconds: float) -> None:
        self.asks[name] = self.asks.get(name, 0) + n_sequences
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def won(self, name: str, accepted: int, worth_sending: bool = True) -> None:
        """One look-up's outcome: the tokens its draft got right (0 without a draft); `worth_sending` False: the
        cost policy found no prefix of the draft worth its verify time (it counts as 0 once `learn` drafts of
        the speculator have been judged)."""
        n = self.judged[name] = self.judged.get(name, 0) + 1
        if not worth_sending and n > self.learn:
            accepted = 0
        v = self._value.get(name, 0.0)
        self._value[name] = v + self.ema * (accepted - v)

    def forget(self, name: str) -> None:
        for d in (self.asks, self.seconds, self._value, self._rounds, self.judged, self._wait):
            d.pop(name, None)
        self.probing.discard(name)

    def skip(self, name: str, seconds_per_token: float) -> bool:
        """True: do not ask `name` this round (its winnings, at `seconds_per_token` each, do not pay its
        look-up)."""
        self.probing.discard(name)  # the last round's probe has been judged (Chain.accept runs between rounds)
        asks = self.asks.get(name, 0)
        if asks < self.warmup:
            return False
        if self._value.get(name, 0.0) * seconds_per_token >= self.seconds[name] / asks:
            self._wait.pop(name, None)  # paying: if it is gated again, probes start over at probe_every
            self._rounds.pop(name, None)
            return False
        n = self._rounds[name] = self._rounds.get(name, 0) + 1
        wait = self._wait.get(name, self.probe_every)
        if n >= wait:  # a probe; the next one waits twice as long, unless this one finds it paying
            self._rounds[name] = 0
            self._wait[name] = min(2 * wait, self.max_probe_every)
            self.probing.add(name)
            return False
        self.skipped[name] = self.skipped.get(name, 0) + 1
        return True
