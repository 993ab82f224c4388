"""Shadow look-ups for online tuning (engine/tuning.py): now and then every setting of a tuned speculator
drafts for the same sequence at the same point; the drafts are kept (not sent), and once the sequence has
gone on far enough to know how each would have fared (its sent prefix matched or missed) each is judged
against the tokens the target really emitted there.

Why not judge each setting on the rounds it is used for (a bandit exploring live)? Because then each setting
is judged on other sequences at other points: a setting tried on the first rounds of a sequence, with little
history to match, looks worse than one tried later, and the noise between rounds (a long copy here, nothing
there) is far larger than the differences to find. The run ends before the bandit knows. Judged side by side
on the same history, the settings differ only by themselves, and no bad setting's draft is ever sent: what
exploring costs is look-up time alone, which the tuner bounds (ChainConfig.tune_explore).

A shadow draft is priced as the cost policy would have sent it: the prefix whose expected accepted tokens
(the speculator's acceptance estimate for a draft that long) best beat the verify time (`send_length`, as
chain.draft_value), credited with the tokens of that prefix the target kept, less its verify time and its own
look-up time, in tokens of the round's plain rate (`shadow_gain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .acceptance import judge


def send_length(prefix_probs: np.ndarray, time_tokens: np.ndarray) -> int:
    """Tokens of a draft the cost policy would send: the prefix length k maximising expected accepted tokens
    (sum of prefix_probs[:k]) less the tokens its verify rows cost (time_tokens[k-1]); 0 when no prefix
    gains. A free round (time_tokens empty) sends the whole draft.

    >>> send_length(np.array([0.9, 0.8, 0.3]), np.array([0.5, 1.0, 1.5]))   # 0.4, 0.7, 0.5: two tokens
    2
    >>> send_length(np.array([0.2, 0.1]), np.array([0.5, 1.0]))
    0
    >>> send_length(np.array([0.2, 0.1]), np.zeros(0))
    2
    """
    n = len(prefix_probs)
    if n == 0:
        return 0
    if len(time_tokens) < n:
        return n
    net = np.cumsum(prefix_probs) - time_tokens[:n]
    k = int(np.argmax(net))
    return k + 1 if net[k] > 0 else 0


def shadow_gain(draft: np.ndarray, send: int, continuation: np.ndarray, time_tokens: np.ndarray,
                lookup_tokens: float) -> float:
    """What a shadow draft would have gained, in tokens: of its first `send` tokens, those the target kept
    (the prefix equal to `continuation`, the tokens that really followed), less their verify time and the
    look-up's.

    >>> shadow_gain(np.array([5, 6, 7, 8]), 3, np.array([5, 6, 9, 9]), np.array([0.2, 0.4, 0.6, 0.8]), 0.05)
    1.35
    >>> shadow_gain(np.array([5, 6]), 0, np.array([5, 6]), np.array([0.2, 0.4]), 0.05)   # not sent
    -0.05
    """
    gain = -lookup_tokens
    if send > 0:
        verify = float(time_tokens[send - 1]) if len(time_tokens) >= send else 0.0
        gain += judge(draft[:send], continuation)[0] - verify  # the tokens of the sent prefix the target kept
    return round(gain, 6)


@dataclass
class Shadow:
    """One sequence's shadow drafts, one per setting, waiting for the tokens that followed them."""

    cls: str  # the sequence class whose bandit they teach
    pos: int  # history length when drafted: the drafts guess history[pos:]
    drafts: list[np.ndarray]
    sends: list[int]  # tokens of each the cost policy would have sent (send_length)
    time_tokens: np.ndarray  # the round's verify time in tokens (Pricing.time_in_tokens)
    lookup_tokens: list[float]  # each look-up's time, in tokens

    def decided(self, history: np.ndarray) -> bool:
        """Whether every draft's fate is known from `history`: only the prefix the cost policy would have sent
        counts, and it is known once the target emitted that many tokens after `pos`, or one that differs.

        >>> sh = Shadow("c", 2, [np.array([5, 6, 7]), np.array([9, 9])], [3, 1], np.zeros(3), [0.0, 0.0])
        >>> sh.decided(np.array([1, 2, 5])), sh.decided(np.array([1, 2, 5, 8]))  # 6 still to come; 8 differs
        (False, True)
        """
        for d, s in zip(self.drafts, self.sends):
            known = history[self.pos:self.pos + s]
            if len(known) < s and np.array_equal(known, d[:len(known)]):
                return False
        return True

    def gains(self, history: np.ndarray) -> list[float]:
        cont = np.asarray(history[self.pos:self.pos + max(self.sends, default=0)])
        return [shadow_gain(d, s, cont, self.time_tokens, lk)
                for d, s, lk in zip(self.drafts, self.sends, self.lookup_tokens)]


#: shadows a sequence may have waiting per speculator: one a round while their sent prefixes are unknown
MAX_WAITING = 4


class ShadowLedger:
    """Shadows waiting to be judged, per (speculator, sequence), oldest first.

    >>> ledger = ShadowLedger()
    >>> ledger.add("x", 0, Shadow("c", 2, [np.array([5, 6])], [2], np.zeros(2), [0.0]))
    >>> ledger.add("x", 0, Shadow("c", 3, [np.array([6, 8])], [2], np.zeros(2), [0.0]))
    >>> ledger.waiting("x", 0), ledger.due("x", 0, np.array([1, 2, 5, 6]))   # the first is known, not the second
    (2, [('c', [2.0])])
    >>> ledger.due("x", 0, np.array([1, 2, 5, 6, 7]))   # 7, not 8: the second got one token right
    [('c', [1.0])]
    """

    def __init__(self) -> None:
        self.pending: dict[tuple[str, int], list[Shadow]] = {}

    def waiting(self, name: str, seq_id: int) -> int:
        return len(self.pending.get((name, seq_id), ()))

    def add(self, name: str, seq_id: int, shadow: Shadow) -> None:
        self.pending.setdefault((name, seq_id), []).append(shadow)

    def due(self, name: str, seq_id: int, history: np.ndarray) -> list[tuple[str, list[float]]]:
        """(class, gain per setting) of each of the sequence's shadows whose drafts' fates are all known (then
        forgotten)."""
        waiting = self.pending.get((name, seq_id))
        if not waiting:
            return []
        known = [sh.decided(history) for sh in waiting]
        if not any(known):
            return []
        left = [sh for sh, k in zip(waiting, known) if not k]
        if left:
            self.pending[(name, seq_id)] = left
        else:
            del self.pending[(name, seq_id)]
        return [(sh.cls, sh.gains(history)) for sh, k in zip(waiting, known) if k]

    def forget(self, seq_id: int) -> None:
        """The sequence ended (its slot may start another): the shadows it left are judged on nothing."""
        for key in [k for k in self.pending if k[1] == seq_id]:
            del self.pending[key]
