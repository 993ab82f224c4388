"""Each speculator's acceptance estimate: what its next draft's tokens are worth before they are verified.

Per speculator, an AcceptanceTracker (per sequence and context: acceptance.py)
and a PrefixCalibration (its bias by position: calibration.py). A draft's
context is its speculator's own bucket (Speculator.draft_context) and whether
another speculator's draft for the sequence starts with the same token
(agree), another token (disagree) or there is none: two speculators that
agree are right more often than either alone, and when they disagree at most
one of them is. Estimates are made on first use of a name and dropped with
`forget` (a rebuilt speculator's estimates measured the old one).

>>> import numpy as np
>>> e = ValueEstimates()
>>> raw, cal = e.estimate("suffix", 0, 3)   # the prior: acceptance falls with position
>>> bool(raw[0] > raw[1] > raw[2]), len(cal)
(True, 3)
>>> for _ in range(30): _ = e.judged("suffix", 0, np.array([4, 5], np.int32), np.array([4, 5, 9], np.int32), 0)
>>> bool(e.estimate("suffix", 0, 1)[0][0] > 0.9)
True
"""

from __future__ import annotations

import numpy as np

from .acceptance import N_POS_BUCKETS, RATE_EPS, AcceptanceTracker, judge
from .calibration import P_MAX, PrefixCalibration

try:  # the compiled core of ValueEstimates.estimate (setup.py builds it; _estimate_core.c)
    from ._estimate_core import CONSTANTS as _CORE_CONSTANTS
    from ._estimate_core import estimate as _core_estimate
except ImportError:  # not built: estimate_reference runs, with the same results
    _CORE_CONSTANTS = _core_estimate = None

if _core_estimate is not None and _CORE_CONSTANTS != (N_POS_BUCKETS, RATE_EPS, P_MAX):
    raise ImportError(f"_estimate_core.c's constants {_CORE_CONSTANTS} are not acceptance.py's and calibration.py's "
                      f"{(N_POS_BUCKETS, RATE_EPS, P_MAX)}: rebuild it (pip install -e .)")

#: whether ValueEstimates.estimate runs compiled here
COMPILED_CORE = _core_estimate is not None

#: a speculator's own context buckets (Speculator.draft_context) kept apart by the acceptance estimate;
#: each is split 3 ways by agreement with the other speculators' drafts
CONTEXT_OWN_BUCKETS = 4


def draft_context(own: int, draft: np.ndarray, others: list[np.ndarray]) -> int:
    """The estimate's context of `draft`: its speculator's own bucket (capped) x 3 + agreement with `others`
    (0: no other draft, 1: one starts with the same token, 2: they all start otherwise).

    >>> d = np.array([4, 5])
    >>> draft_context(0, d, []), draft_context(1, d, [np.array([4])]), draft_context(9, d, [np.array([7])])
    (0, 4, 11)
    """
    agree = 0 if not others else (1 if any(o[0] == draft[0] for o in others) else 2)
    return min(own, CONTEXT_OWN_BUCKETS - 1) * 3 + agree


class ValueEstimates:
    #: estimate with the compiled core where it is built; False (on the class) runs estimate_reference
    compiled = True

    def __init__(self) -> None:
        self._trackers: dict[str, AcceptanceTracker] = {}
        self._calibrations: dict[str, PrefixCalibration] = {}

    def tracker(self, name: str) -> AcceptanceTracker:
        t = self._trackers.get(name)
        if t is None:
            t = self._trackers[name] = AcceptanceTracker(n_contexts=3 * CONTEXT_OWN_BUCKETS)
        return t

    def calibration(self, name: str) -> PrefixCalibration:
        c = self._calibrations.get(name)
        if c is None:
            c = self._calibrations[name] = PrefixCalibration()
        return c

    def estimate(self, name: str, seq_id: int, length: int, context: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(raw, calibrated) P(first j+1 tokens of name's next draft for seq_id all accepted), j < length. Runs the
        compiled core (_estimate_core.c) where it is built and `compiled` is on, else `estimate_reference`: the
        two give bitwise the same arrays."""
        if _core_estimate is None or not self.compiled or length <= 0:
            return self.estimate_reference(name, seq_id, length, context)
        t = self.tracker(name)
        g = t.global_rate()
        ctx = min(max(int(context), 0), t.n_contexts - 1)
        st = t.state(seq_id)
        out = np.empty((2, length))
        _core_estimate(out, t.pos_acc, t.pos_trials, t.state_acc[st, ctx], t.state_trials[st, ctx], g,
                       t.position_weight, t.state_weight, t.odds_factor(seq_id, g), self.calibration(name).factor_list())
        return out[0], out[1]

    def estimate_reference(self, name: str, seq_id: int, length: int, context: int = 0) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
        """`estimate` in Python (AcceptanceTracker.prefix_probs, then PrefixCalibration.apply): the reference the
        compiled core is held to (tests/unit/test_estimate_core.py), and what runs where it is not built."""
        raw = self.tracker(name).prefix_probs(seq_id, length, context)
        return raw, self.calibration(name).apply(raw)

    def rate(self, name: str, seq_id: int) -> float:
        """`name`'s acceptance rate on seq_id (the `expected` policy's score)."""
        return self.tracker(name).rate(seq_id)

    def judged(self, name: str, seq_id: int, draft: np.ndarray, emitted: np.ndarray, context: int) -> int:
        """Learn from `draft` (sent or not) against the tokens the target emitted; returns how many were right."""
        m, censored = judge(draft, emitted)
        self.tracker(name).update(seq_id, len(draft), m, censored, context)
        return m

    def sent(self, name: str, seq_id: int, n_drafted: int, n_accepted: int) -> None:
        """Learn from a sent draft's verdict alone (no emitted tokens to judge the others by)."""
        self.tracker(name).update(seq_id, n_drafted, n_accepted)

    def calibrate(self, name: str, raw_probs: np.ndarray, n_accepted: int) -> None:
        """The sent draft's raw estimate against how many of its tokens were accepted."""
        self.calibration(name).update(raw_probs, n_accepted)

    def end(self, seq_id: int, names: tuple[str, ...]) -> None:
        for name in names:
            if name in self._trackers:
                self._trackers[name].end(seq_id)

    def forget(self, name: str) -> None:
        """Drop `name`'s estimates: a rebuilt instance starts from the prior."""
        self._trackers.pop(name, None)
        self._calibrations.pop(name, None)

    def snapshot(self) -> dict:
        """Per speculator: its global acceptance rate and calibration factors by position."""
        return {n: {"acceptance": round(t.global_rate(), 4),
                    "calibration": [round(f, 4) for f in self.calibration(n).factor_list()]}
                for n, t in sorted(self._trackers.items())}
