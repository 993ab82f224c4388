"""Estimates of how likely a speculator's next draft tokens are accepted.

Token-level geometric model: each draft token is accepted with probability a,
independently, until the first rejection. A verified draft of k tokens with n
accepted gives n successes out of min(k, n + 1) trials (the tokens after the
first rejection were never judged). The estimate per (sequence, speculator)
is shrunk towards the speculator's global rate, itself shrunk towards a prior,
so a new sequence starts from what the speculator did for earlier ones.

>>> t = AcceptanceTracker(prior=0.5, prior_weight=2.0, seq_weight=4.0)
>>> t.update(seq_id=0, n_drafted=4, n_accepted=4)
>>> round(t.rate(0), 3), round(t.rate(1), 3)   # seq 0 saw 4/4, seq 1 only the global rate
(0.917, 0.833)
"""

from __future__ import annotations

import numpy as np


class AcceptanceTracker:
    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, seq_weight: float = 4.0,
                 recent_decay: float = 0.9) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.seq_weight = seq_weight
        self.recent_decay = recent_decay  # old per-seq evidence fades: a sequence's text changes
        self.global_acc = 0.0
        self.global_trials = 0.0
        self._seq: dict[int, list[float]] = {}

    def global_rate(self) -> float:
        return (self.global_acc + self.prior * self.prior_weight) / (self.global_trials + self.prior_weight)

    def rate(self, seq_id: int) -> float:
        g = self.global_rate()
        acc, trials = self._seq.get(seq_id, (0.0, 0.0))
        return (acc + g * self.seq_weight) / (trials + self.seq_weight)

    def update(self, seq_id: int, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        trials = min(n_drafted, n_accepted + 1)
        self.global_acc += n_accepted
        self.global_trials += trials
        s = self._seq.setdefault(seq_id, [0.0, 0.0])
        s[0] = s[0] * self.recent_decay + n_accepted
        s[1] = s[1] * self.recent_decay + trials

    def prefix_probs(self, seq_id: int, length: int) -> np.ndarray:
        """P(first j+1 draft tokens all accepted), j = 0..length-1."""
        a = self.rate(seq_id)
        return a ** np.arange(1, length + 1, dtype=np.float64)

    def end(self, seq_id: int) -> None:
        self._seq.pop(seq_id, None)
