"""Where a round's time goes: contiguous stamps of the round thread, by stage.

A round is admission, planning, drafting, building the target's rows, the
target call (its llama_decode, its verification, and the rest: batch filling,
KV rollback and, for a target actor, the hop), acceptance bookkeeping,
emission (detokenising, finishing), delivery to the listeners and learning
from the round (its timing into the price models, its stamps into the
stats; with overlapped rounds that runs in the next round's decode, else
every few rounds for the rounds since, in the last one's `learn`). Every
second of `Scheduler.step` is in exactly one stage, so the stages add up to
the round; everything but `decode` is host work, the part that does not shrink
when the target runs on a faster device (on a GPU, where a small model's decode
is short, it is much of every token's time). The bench's own instrumentation
inside the target call (top-2 margins, EngineConfig.record_margins) is timed
apart, as `instrument`: no server does that work, so the round's time, its host
time and the bench's speeds leave it out.

>>> clock = RoundClock(t0=0.0)
>>> clock.lap("admit", 0.001); clock.lap("draft", 0.004)
>>> clock.split_target(0.014, decode=0.008, verify=0.001)   # the target call took 10 ms of wall time
>>> clock.lap("emit", 0.015)
>>> {k: round(v * 1e3, 3) for k, v in clock.seconds.items()}
{'admit': 1.0, 'draft': 3.0, 'decode': 8.0, 'verify': 1.0, 'target_rest': 1.0, 'emit': 1.0}
>>> round(clock.total * 1e3, 3)
15.0
"""

from __future__ import annotations

import time

#: every stage a round may report, in the order a round runs them
STAGES = ("admit", "plan", "draft", "build", "decode", "verify", "target_rest", "accept", "emit", "deliver",
          "learn")
#: the bench's instrumentation inside the target call (record_margins): timed, but in no stage
INSTRUMENT = "instrument"


class RoundClock:
    """Stamps of one round: each lap charges the time since the previous stamp to a stage."""

    __slots__ = ("t0", "t", "seconds")

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = self.t = time.perf_counter() if t0 is None else t0
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.t
        self.t = now

    def split_target(self, now: float | None, decode: float, verify: float, instrument: float = 0.0) -> None:
        """Charge the target call (since the last stamp) to its llama_decode, its verification, the bench's
        instrumentation (`instrument`, not a stage: INSTRUMENT) and the rest (batch filling, rollback, a remote
        target's hop and row transport): the rest never goes negative, a remote target's own clocks may run a
        little ahead of the caller's.

        >>> clock = RoundClock(t0=0.0)
        >>> clock.split_target(0.010, decode=0.006, verify=0.001, instrument=0.002)
        >>> {k: round(v * 1e3, 3) for k, v in clock.seconds.items()}, round(clock.work * 1e3, 3)
        ({'decode': 6.0, 'verify': 1.0, 'instrument': 2.0, 'target_rest': 1.0}, 8.0)
        """
        now = time.perf_counter() if now is None else now
        wall = now - self.t
        decode = min(max(0.0, decode), wall)
        verify = min(max(0.0, verify), wall - decode)
        instrument = min(max(0.0, instrument), wall - decode - verify)
        for k, v in (("decode", decode), ("verify", verify), (INSTRUMENT, instrument),
                     ("target_rest", wall - decode - verify - instrument)):
            if v or k != INSTRUMENT:
                self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.t = now

    @property
    def total(self) -> float:
        return self.t - self.t0

    @property
    def work(self) -> float:
        """The round's time less the bench's instrumentation: what a server's round would have taken."""
        return self.total - self.seconds.get(INSTRUMENT, 0.0)


def breakdown(stage_seconds: dict[str, float], rounds: int, seq_rounds: int) -> dict:
    """Milliseconds per round of each stage, host time (all but `decode`) per round and per decoding
    sequence-round (host time / sum over rounds of the sequences decoding in it).

    >>> b = breakdown({"decode": 0.8, "draft": 0.03, "accept": 0.01}, rounds=100, seq_rounds=200)
    >>> b["ms_per_round"], round(b["host_ms_per_round"], 3), round(b["host_ms_per_seq_round"], 3)
    ({'draft': 0.3, 'decode': 8.0, 'accept': 0.1}, 0.4, 0.2)
    """
    ms = {k: 1e3 * stage_seconds[k] / rounds for k in STAGES if k in stage_seconds} if rounds else {}
    host = sum(v for k, v in stage_seconds.items() if k in STAGES and k != "decode")
    return {"ms_per_round": ms,
            "host_ms_per_round": 1e3 * host / rounds if rounds else None,
            "host_ms_per_seq_round": 1e3 * host / seq_rounds if seq_rounds else None}
