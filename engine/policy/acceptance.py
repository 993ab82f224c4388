"""Estimates of how likely a speculator's next draft tokens are accepted.

Three layers, all learnt from judged drafts:

- a per-position *profile*: P(token j accepted | tokens 0..j-1 accepted),
  pooled over all sequences of the speculator. Copy-style speculators are far
  from geometric: the first token of a draft is a gamble, but once a copied
  span starts matching it usually goes on matching, so the conditional rate
  rises with j. Each position is shrunk towards the pooled token rate, so
  positions seen rarely fall back to the geometric model.
- a *state* table: the same profile (by position bucket) for each state of
  the sequence's previous judged draft (none yet / missed at once / partly
  accepted / wholly accepted) and the speculator's own `context` bucket
  (e.g. the suffix match length). A suffix draft right after a wholly
  accepted one keeps more of its tokens than one after a miss: where a
  copied span runs, the next draft runs too. Shrunk towards the profile.
- a per-sequence *shift*: the sequence's own (recency-weighted) token rate
  against the pooled one, applied to every position as an odds ratio.

A judged draft of k tokens with n accepted is n successes out of
min(k, n + 1) trials (tokens after the first rejection were never judged);
position j was tried iff j <= n and j < k. A *censored* verdict (the
chain checked a draft against the tokens the target emitted, and they ran
out before the draft did) is n successes and no failure.

>>> t = AcceptanceTracker(prior=0.5, prior_weight=2.0, seq_weight=4.0)
>>> t.update(seq_id=0, n_drafted=4, n_accepted=4)
>>> round(t.rate(0), 3), round(t.rate(1), 3)   # seq 0 saw 4/4, seq 1 only the global rate
(0.917, 0.833)
>>> t = AcceptanceTracker()
>>> for _ in range(40):   # half the drafts miss at once, the other half copy 8 tokens
...     t.update(0, 8, 0); t.update(0, 8, 8)
>>> [round(float(p), 2) for p in t.prefix_probs(1, 4)]   # a new sequence: flat after the first token
[0.46, 0.46, 0.45, 0.45]
>>> t = AcceptanceTracker()
>>> for s in range(40):   # copied spans run on: runs of 4 accepted drafts, then runs of 4 misses
...     for n in (8, 8, 8, 8, 0, 0, 0, 0): t.update(s, 8, n)
>>> t.update(100, 8, 8); t.update(101, 8, 0)   # the next draft after a whole accept, and after a miss
>>> round(float(t.prefix_probs(100, 1)[0]), 2), round(float(t.prefix_probs(101, 1)[0]), 2)
(0.9, 0.01)
"""

from __future__ import annotations

import functools
import math

import numpy as np

#: a conditional acceptance rate stays within [RATE_EPS, 1 - RATE_EPS] (and so does a logit's argument)
RATE_EPS = 1e-3

#: states of a sequence's previous judged draft (per speculator): none yet, then by how many of its
#: tokens were accepted: 0, 1, 2-3, 4-7, 8+
STATE_NONE = 0
N_STATES = 6
#: position buckets of the state table: 0, 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+
N_POS_BUCKETS = 8
#: a table cell keeps at most this many trials: old evidence fades, so the estimate follows the traffic
CELL_CAP = 4096.0


def _logit(p: float) -> float:
    p = min(max(p, RATE_EPS), 1 - RATE_EPS)
    return math.log(p / (1 - p))


@functools.lru_cache(maxsize=1024)
def pos_buckets(length: int) -> np.ndarray:
    """Bucket of each position 0..length-1: 0, 1, 2-3, 4-7, ... (log2), capped. Memoised (every draft
    of every round asks), so the array is read-only.

    >>> pos_buckets(9).tolist()
    [0, 1, 2, 2, 3, 3, 3, 3, 4]
    """
    j = np.arange(length)
    b = np.zeros(length, dtype=np.int64)
    b[1:] = np.floor(np.log2(j[1:])).astype(np.int64) + 1
    b = np.minimum(b, N_POS_BUCKETS - 1)
    b.setflags(write=False)
    return b


@functools.lru_cache(maxsize=1024)
def pos_bucket_list(length: int) -> tuple[int, ...]:
    """pos_buckets as a tuple of ints (memoised): for the per-position Python loops.

    >>> pos_bucket_list(5)
    (0, 1, 2, 2, 3)
    """
    return tuple(pos_buckets(length).tolist())


@functools.lru_cache(maxsize=1024)
def bucket_counts(length: int) -> np.ndarray:
    """How many of the positions 0..length-1 fall in each bucket (read-only).

    >>> bucket_counts(9).astype(int).tolist()
    [1, 1, 2, 4, 1, 0, 0, 0]
    """
    c = np.bincount(pos_buckets(length), minlength=N_POS_BUCKETS).astype(np.float64)
    c.setflags(write=False)
    return c


def next_state(n_accepted: int) -> int:
    """State after a judged draft with n_accepted tokens accepted.

    >>> [next_state(n) for n in (0, 1, 2, 3, 4, 8, 50)]
    [1, 2, 3, 3, 4, 5, 5]
    """
    if n_accepted <= 0:
        return 1
    return min(1 + int(n_accepted).bit_length(), N_STATES - 1)  # bit_length - 1 = floor(log2), exactly


class AcceptanceTracker:
    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, seq_weight: float = 4.0,
                 recent_decay: float = 0.9, position_weight: float = 4.0, state_weight: float = 8.0,
                 max_positions: int = 256, n_contexts: int = 8) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.seq_weight = seq_weight
        self.recent_decay = recent_decay  # old per-seq evidence fades: a sequence's text changes
        self.position_weight = position_weight  # pseudo-trials of the pooled rate at each position
        self.state_weight = state_weight  # pseudo-trials of the profile in each state cell
        self.n_contexts = n_contexts
        self.global_acc = 0.0
        self.global_trials = 0.0
        self.pos_acc = np.zeros(max_positions)
        self.pos_trials = np.zeros(max_positions)
        # [state, context, position bucket]
        self.state_acc = np.zeros((N_STATES, n_contexts, N_POS_BUCKETS))
        self.state_trials = np.zeros((N_STATES, n_contexts, N_POS_BUCKETS))
        self._seq: dict[int, list[float]] = {}
        self._cell_bound: dict[tuple[int, int], float] = {}  # (state, context) -> bound on its largest count
        self._state: dict[int, int] = {}

    def global_rate(self) -> float:
        return (self.global_acc + self.prior * self.prior_weight) / (self.global_trials + self.prior_weight)

    def rate(self, seq_id: int) -> float:
        g = self.global_rate()
        acc, trials = self._seq.get(seq_id, (0.0, 0.0))
        return (acc + g * self.seq_weight) / (trials + self.seq_weight)

    def odds_factor(self, seq_id: int, g: float | None = None) -> float:
        """exp(logit(rate(seq_id)) - logit(g)): the factor the sequence's own rate scales every position's odds by
        (`conditional`); g: the global rate, where the caller has it.

        >>> t = AcceptanceTracker()
        >>> t.update(0, 4, 4)
        >>> t.odds_factor(0) > 1.0, t.odds_factor(1)   # seq 0 beats the global rate; an unseen one is at it
        (True, 1.0)
        """
        return math.exp(_logit(self.rate(seq_id)) - _logit(self.global_rate() if g is None else g))

    def state(self, seq_id: int) -> int:
        return self._state.get(seq_id, STATE_NONE)

    def update(self, seq_id: int, n_drafted: int, n_accepted: int, censored: bool = False,
               context: int = 0) -> None:
        """One judged draft of seq_id: n_accepted of its n_drafted tokens kept (censored: the judgement
        stopped after n_accepted matching tokens without a rejection)."""
        if n_drafted <= 0:
            return
        n_accepted = min(n_accepted, n_drafted)
        trials = n_accepted if censored else min(n_drafted, n_accepted + 1)
        if trials <= 0:
            return
        self.global_acc += n_accepted
        self.global_trials += trials
        m = min(trials, len(self.pos_trials))
        self.pos_trials[:m] += 1
        self.pos_acc[: min(n_accepted, m)] += 1
        ctx = min(max(int(context), 0), self.n_contexts - 1)
        st = self.state(seq_id)
        self.state_trials[st, ctx] += bucket_counts(trials)
        self.state_acc[st, ctx] += bucket_counts(n_accepted)  # the first n_accepted of the tried positions
        # a cell's largest count grows by at most `trials` an update: look at the cell (numpy) only once that
        # bound passes the cap (the check ran for every judged draft, every round)
        bound = self._cell_bound[st, ctx] = self._cell_bound.get((st, ctx), 0.0) + trials
        if bound > CELL_CAP:
            self._fade(st, ctx)
            self._cell_bound[st, ctx] = float(self.state_trials[st, ctx].max())
        if self.pos_trials[0] > CELL_CAP:
            self._fade_positions()
        s = self._seq.setdefault(seq_id, [0.0, 0.0])
        s[0] = s[0] * self.recent_decay + n_accepted
        s[1] = s[1] * self.recent_decay + trials
        self._state[seq_id] = next_state(n_accepted)

    def _fade(self, st: int, ctx: int) -> None:
        cell_t, cell_a = self.state_trials[st, ctx], self.state_acc[st, ctx]
        over = cell_t > CELL_CAP
        if over.any():
            scale = np.where(over, CELL_CAP / np.maximum(cell_t, 1.0), 1.0)
            cell_t *= scale
            cell_a *= scale

    def _fade_positions(self) -> None:
        """pos_trials[0] (every judged draft tries position 0: the largest) passed the cap: scale all down."""
        scale = CELL_CAP / self.pos_trials[0]
        self.pos_trials *= scale
        self.pos_acc *= scale
        self.global_acc *= scale
        self.global_trials *= scale

    def position_profile(self, length: int) -> np.ndarray:
        """Pooled P(token j accepted | 0..j-1 accepted), j = 0..length-1."""
        g = self.global_rate()
        m = min(length, len(self.pos_trials))
        w = self.position_weight
        prof = (self.pos_acc[:m] + w * g) / (self.pos_trials[:m] + w)
        return prof if m == length else np.concatenate([prof, np.full(length - m, g)])

    def conditional(self, seq_id: int, length: int, context: int = 0) -> np.ndarray:
        """P(token j accepted | 0..j-1 accepted) for seq_id's next draft, j = 0..length-1: the pooled profile,
        pulled toward the (state, context) cell's rates, then shifted in logit space by how the sequence's own
        rate differs from the global one. The shift is applied as odds times exp(shift), which is the logit
        shift's sigmoid without a log and an exp per position, and np.minimum/np.maximum stand in for np.clip:
        this runs for every draft scored, every round (the values move by rounding only).

        >>> t = AcceptanceTracker()
        >>> for _ in range(20): t.update(0, 4, 2)
        >>> t.conditional(0, 4).round(3)
        array([0.984, 0.984, 0.033, 0.198])
        """
        prof = self.position_profile(length)
        ctx = min(max(int(context), 0), self.n_contexts - 1)
        st = self.state(seq_id)
        b = pos_buckets(length)
        acc, trials = self.state_acc[st, ctx][b], self.state_trials[st, ctx][b]
        w = self.state_weight
        cond = np.minimum(np.maximum((acc + w * prof) / (trials + w), RATE_EPS), 1 - RATE_EPS)
        # sigmoid(logit(c) + shift) = c k / (c k + 1 - c), k = exp(shift)
        ck = cond * self.odds_factor(seq_id)
        return ck / (ck + (1.0 - cond))

    def prefix_probs(self, seq_id: int, length: int, context: int = 0) -> np.ndarray:
        """P(first j+1 draft tokens all accepted), j = 0..length-1: the running product of `conditional`,
        computed the same way position by position in Python floats. Why not numpy: this runs for every draft
        scored, every round, on 1-8 positions, where a dozen numpy calls cost more than the arithmetic (the
        values are bitwise the same, tests/unit/test_acceptance_fast.py).

        >>> t = AcceptanceTracker()
        >>> for _ in range(20): t.update(0, 4, 2)
        >>> bool(np.array_equal(t.prefix_probs(0, 4), np.cumprod(t.conditional(0, 4))))
        True
        """
        if length <= 0:
            return np.zeros(0)
        g = self.global_rate()
        m = min(length, len(self.pos_trials))
        w = self.position_weight
        wg = w * g
        pos_acc, pos_trials = self.pos_acc[:m].tolist(), self.pos_trials[:m].tolist()
        ctx = min(max(int(context), 0), self.n_contexts - 1)
        st = self.state(seq_id)
        cell_acc, cell_trials = self.state_acc[st, ctx].tolist(), self.state_trials[st, ctx].tolist()
        ws = self.state_weight
        k = self.odds_factor(seq_id, g)
        buckets = pos_bucket_list(length)
        out = [0.0] * length
        run = 1.0
        for j in range(length):  # conditional's steps, in its order
            prof = (pos_acc[j] + wg) / (pos_trials[j] + w) if j < m else g
            b = buckets[j]
            c = min(max((cell_acc[b] + ws * prof) / (cell_trials[b] + ws), RATE_EPS), 1 - RATE_EPS)
            ck = c * k
            run *= ck / (ck + (1.0 - c))
            out[j] = run
        return np.array(out)

    def end(self, seq_id: int) -> None:
        self._seq.pop(seq_id, None)
        self._state.pop(seq_id, None)


def judge(draft: np.ndarray, emitted: np.ndarray) -> tuple[int, bool]:
    """How a draft fares against the tokens the target emitted after the same history: (tokens it
    gets accepted, censored). Censored: every emitted token matched and the draft goes on, so its
    tail is unjudged. Exact for greedy and for coupled sampling (a draft token is accepted iff it
    equals the token the target samples at its position).

    >>> judge(np.array([5, 6, 7]), np.array([5, 9]))
    (1, False)
    >>> judge(np.array([5, 6, 7]), np.array([5, 6]))
    (2, True)
    >>> judge(np.array([5, 6]), np.array([5, 6, 8]))
    (2, False)
    """
    n = min(len(draft), len(emitted))
    if n == 0:
        return 0, len(draft) > 0
    # Python ints, not numpy: every asked speculator's draft is judged, every round, on a few tokens
    m = 0
    for a, b in zip(draft[:n].tolist() if isinstance(draft, np.ndarray) else draft[:n],
                    emitted[:n].tolist() if isinstance(emitted, np.ndarray) else emitted[:n]):
        if a != b:
            break
        m += 1
    return m, (m == len(emitted) and m < len(draft))
