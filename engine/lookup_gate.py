"""When a speculator's look-up costs more than its drafts win: ask it only now and then.

Every speculator of a chain is asked for a draft every round, and each
look-up costs host time (0.03-0.05 ms for the n-gram and suffix speculators
here), whether or not its draft is the one sent. A speculator whose drafts
seldom win (another speculator of the chain drafts the same or better) pays
that on every token for nothing; on a GPU, where a round of a small model
takes 1-2 ms, three such look-ups are 5-10% of the round. So each speculator's
winnings are followed: the tokens its draft gets right per look-up (judged
against what the target emitted, sent or not, so the gate does not follow the
planner's cuts; an exponential average), worth the round's time per token each. Once it has been
asked `warmup` times and its winnings are worth less than its look-up, it is
asked only one round in `probe_every` (so a change in the traffic is still
seen). Drafts never change what is emitted, so this is lossless.

>>> g = LookupGate(warmup=4, probe_every=4)
>>> for _ in range(8):
...     g.asked("ngram_mod", 1, 0.00004)   # 0.04 ms a look-up
...     g.won("ngram_mod", 0)              # its drafts are never right
>>> [g.skip("ngram_mod", 0.002) for _ in range(8)]   # 2 ms a token: asked every 4th round
[True, True, True, False, True, True, True, False]
>>> g.skip("suffix", 0.002)   # not seen yet
False
"""

from __future__ import annotations


class LookupGate:
    def __init__(self, warmup: int = 64, probe_every: int = 8, ema: float = 0.02) -> None:
        self.warmup, self.probe_every, self.ema = warmup, probe_every, ema
        self.asks: dict[str, int] = {}  # sequences each speculator was asked for
        self.seconds: dict[str, float] = {}  # its look-up time, summed
        self._value: dict[str, float] = {}  # accepted tokens of its sent drafts per look-up, averaged
        self._rounds: dict[str, int] = {}  # rounds it was gated in, for the probes
        self.skipped: dict[str, int] = {}  # rounds it was not asked in (stats)

    def asked(self, name: str, n_sequences: int, seconds: float) -> None:
        self.asks[name] = self.asks.get(name, 0) + n_sequences
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def won(self, name: str, accepted: int) -> None:
        """One look-up's outcome: the tokens its draft got right (0 without a draft)."""
        v = self._value.get(name, 0.0)
        self._value[name] = v + self.ema * (accepted - v)

    def forget(self, name: str) -> None:
        for d in (self.asks, self.seconds, self._value, self._rounds):
            d.pop(name, None)

    def skip(self, name: str, seconds_per_token: float) -> bool:
        """True: do not ask `name` this round (its winnings, at `seconds_per_token` each, do not pay its
        look-up)."""
        asks = self.asks.get(name, 0)
        if asks < self.warmup:
            return False
        if self._value.get(name, 0.0) * seconds_per_token >= self.seconds[name] / asks:
            return False
        n = self._rounds[name] = self._rounds.get(name, 0) + 1
        if n % self.probe_every == 0:
            return False
        self.skipped[name] = self.skipped.get(name, 0) + 1
        return True
