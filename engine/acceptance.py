"""Estimates of how likely a speculator's next draft tokens are accepted.

Two layers, both learnt from verified drafts:

- a per-position *profile*: P(token j accepted | tokens 0..j-1 accepted),
  pooled over all sequences of the speculator. Copy-style speculators are far
  from geometric: the first token of a draft is a gamble, but once a copied
  span starts matching it usually goes on matching, so the conditional rate
  rises with j. Each position is shrunk towards the pooled token rate, so
  positions seen rarely fall back to the geometric model.
- a per-sequence *shift*: the sequence's own (recency-weighted) token rate
  against the pooled one, applied to every position as an odds ratio, so a
  sequence whose text stopped repeating gets shorter drafts at once.

A verified draft of k tokens with n accepted is n successes out of
min(k, n + 1) trials (tokens after the first rejection were never judged);
position j was tried iff j <= n and j < k.

>>> t = AcceptanceTracker(prior=0.5, prior_weight=2.0, seq_weight=4.0)
>>> t.update(seq_id=0, n_drafted=4, n_accepted=4)
>>> round(t.rate(0), 3), round(t.rate(1), 3)   # seq 0 saw 4/4, seq 1 only the global rate
(0.917, 0.833)
>>> t = AcceptanceTracker()
>>> for _ in range(40):   # half the drafts miss at once, the other half copy 8 tokens
...     t.update(0, 8, 0); t.update(0, 8, 8)
>>> [round(float(p), 2) for p in t.prefix_probs(1, 4)]   # flat after the first token, not 0.5**j
[0.52, 0.51, 0.51, 0.5]
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-3


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return float(np.log(p / (1 - p)))


class AcceptanceTracker:
    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, seq_weight: float = 4.0,
                 recent_decay: float = 0.9, position_weight: float = 4.0, max_positions: int = 256) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.seq_weight = seq_weight
        self.recent_decay = recent_decay  # old per-seq evidence fades: a sequence's text changes
        self.position_weight = position_weight  # pseudo-trials of the pooled rate at each position
        self.global_acc = 0.0
        self.global_trials = 0.0
        self.pos_acc = np.zeros(max_positions)
        self.pos_trials = np.zeros(max_positions)
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
        m = min(trials, len(self.pos_trials))
        self.pos_trials[:m] += 1
        self.pos_acc[: min(n_accepted, m)] += 1
        s = self._seq.setdefault(seq_id, [0.0, 0.0])
        s[0] = s[0] * self.recent_decay + n_accepted
        s[1] = s[1] * self.recent_decay + trials

    def position_profile(self, length: int) -> np.ndarray:
        """Pooled P(token j accepted | 0..j-1 accepted), j = 0..length-1."""
        g = self.global_rate()
        m = min(length, len(self.pos_trials))
        w = self.position_weight
        prof = np.full(length, g)
        prof[:m] = (self.pos_acc[:m] + w * g) / (self.pos_trials[:m] + w)
        return prof

    def prefix_probs(self, seq_id: int, length: int) -> np.ndarray:
        """P(first j+1 draft tokens all accepted), j = 0..length-1."""
        if length <= 0:
            return np.zeros(0)
        prof = np.clip(self.position_profile(length), _EPS, 1 - _EPS)
        shift = _logit(self.rate(seq_id)) - _logit(self.global_rate())
        cond = 1.0 / (1.0 + np.exp(-(np.log(prof / (1 - prof)) + shift)))
        return np.cumprod(cond)

    def end(self, seq_id: int) -> None:
        self._seq.pop(seq_id, None)
