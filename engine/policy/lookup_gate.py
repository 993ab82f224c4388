"""When a speculator's look-up costs more than its drafts win: ask it only now and then.

Every speculator of a chain is asked for a draft every round, and each look-up
costs host time, whether or not its draft is the one sent. A speculator whose
drafts seldom win (another speculator of the chain drafts the same or better)
pays that on every token for nothing; on a GPU, where a round of a small model
is short, a few such look-ups are a sizeable share of the round. So each speculator's winnings are
followed: the tokens its draft gets right per look-up (judged against what the
target emitted, sent or not, so the gate does not follow the planner's cuts;
an exponential average), worth the round's time per token each. A draft the
cost policy finds worth nothing (no prefix of it pays its verify time at its
estimated acceptance: chain.draft_value) wins nothing, however right it turns
out: at that price it is never sent, so its look-up bought nothing (without
this rule, right-but-unsendable drafts would keep every speculator asked while
almost nothing is sent). That rule waits until `learn` of the
speculator's drafts have been judged, because its acceptance estimate starts
from a prior: one that starts low would find every draft worthless and be
gated. A probe is judged in hindsight instead (chain.judged_worth: did the
tokens it got right beat the time of their verify rows?): a gated speculator's
acceptance estimate learns only on probes, so a probe judged by that estimate
could never see the traffic change (a copy task after chat); once a probe
reopens the gate the estimate learns from every round again. Once it has been
asked `warmup` times and its winnings are worth less than its look-up, it is
asked only for probes, per sequence: on a sequence's 1st, 2nd, 4th, ... gated
round, then every `max_probe_every`-th (64). A new request is probed at once,
so a copy task after chat is seen in its first rounds; a long one is probed
more and more rarely (with many slots and a fast decode, even a fixed probe
of one round in 8 costs look-ups that pay nothing). Drafts never change what is emitted, so this is lossless.

>>> g = LookupGate(warmup=4, max_probe_every=8)
>>> for _ in range(8):
...     g.asked("ngram_mod", 1, 0.00004)   # 0.04 ms a look-up
...     g.won("ngram_mod", 0)              # its drafts are never right
>>> "".join("P" if g.ask("ngram_mod", [0], [5], 0.002) else "." for _ in range(20))   # P: sequence 5 probed
'PP.P...P.......P....'
>>> g.ask("suffix", [0, 1], [5, 6], 0.002)   # not seen yet: asked for every sequence
[0, 1]
"""

from __future__ import annotations


class LookupGate:
    def __init__(self, warmup: int = 64, ema: float = 0.02, learn: int = 64, max_probe_every: int = 64) -> None:
        self.warmup, self.ema, self.learn, self.max_probe_every = warmup, ema, learn, max_probe_every
        self.probing: set[str] = set()  # asked this round as a probe (its drafts judged in hindsight: Chain)
        self.judged: dict[str, int] = {}  # drafts of each speculator judged so far (the worth rule's wait)
        self.asks: dict[str, int] = {}  # sequences each speculator was asked for
        self.seconds: dict[str, float] = {}  # its look-up time, summed
        self._value: dict[str, float] = {}  # accepted tokens of its sent drafts per look-up, averaged
        self._gated: dict[tuple[str, int], int] = {}  # (speculator, sequence) -> gated rounds, for its probes
        self.skipped: dict[str, int] = {}  # look-ups not made (sequences x rounds; stats)

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
        for d in (self.asks, self.seconds, self._value, self.judged):
            d.pop(name, None)
        self._gated = {k: v for k, v in self._gated.items() if k[0] != name}
        self.probing.discard(name)

    def end(self, seq_id: int) -> None:
        """The sequence in `seq_id` is over: the next one there is new traffic, probed from its first round."""
        self._gated = {k: v for k, v in self._gated.items() if k[1] != seq_id}

    def gated(self, name: str, seconds_per_token: float) -> bool:
        """True once `name` has been asked `warmup` times and its winnings, at `seconds_per_token` each, do not
        pay its look-up."""
        asks = self.asks.get(name, 0)
        return asks >= self.warmup and self._value.get(name, 0.0) * seconds_per_token < self.seconds[name] / asks

    def ask(self, name: str, idx: list[int], seq_ids: list[int], seconds_per_token: float) -> list[int]:
        """Which of the requests `idx` (for the sequences `seq_ids`) to ask `name` for this round: all while it
        pays (`gated`); else those due a probe, on each sequence's 1st, 2nd, 4th, ... gated round, then every
        `max_probe_every`-th."""
        self.probing.discard(name)  # the last round's probes have been judged (Chain.accept runs between rounds)
        if not self.gated(name, seconds_per_token):
            return idx
        out = []
        for i, seq_id in zip(idx, seq_ids):
            n = self._gated[(name, seq_id)] = self._gated.get((name, seq_id), 0) + 1
            if (n & (n - 1) == 0 and n <= self.max_probe_every) or n % self.max_probe_every == 0:
                out.append(i)
        self.skipped[name] = self.skipped.get(name, 0) + len(idx) - len(out)
        if out:
            self.probing.add(name)
        return out
