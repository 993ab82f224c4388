"""What a target decode of n tokens costs, measured, not assumed.

On a CPU a verify batch of k tokens costs far more than one token (prompt
processing is only a few times faster per token than decoding), so the chain
must know the price of every draft token it sends. Two parts:

- a table by batch size, measured at start-up after a short prefix and
  followed by the rounds actually run (an exponential average per size);
- attention: every token of a batch attends every KV cell of its stream, so a
  token costs more the longer the context. With one KV stream shared by all
  slots (llama.cpp's unified cache) a token attends the cells of *every*
  slot: with several busy slots of long contexts, a draft token costs a
  multiple of the calibration's price. The model adds `attn_seconds` per (token x cell)
  beyond the calibration's prefix, measured at start-up and learnt online;
- the machine's speed: a shared machine drifts within a minute, and almost
  every round is a 1-row decode (one per busy slot), while draft-sized
  batches are seen rarely. Learnt per size, the often-seen entry would follow
  the drift and the rare ones would not: after a fast spell a 2-row verify
  would be priced far above its cost and drafting would stop for good, since
  no draft means no observation to correct it. So every
  decode first updates one speed factor that scales the whole table, and the
  table (the shape) learns only what that factor does not explain. The size
  seen most often is the unit of the shape and stays fixed: its drift is all
  speed.

>>> m = DecodeCostModel({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024})
>>> round(m.cost(3), 4)   # linear between measured sizes
0.014
>>> round(m.cost(16), 4)  # beyond the table: extrapolate the last slope
0.04
>>> m = DecodeCostModel({1: 0.010, 8: 0.024}, attn_seconds=1e-6, ref_cells=64)
>>> round(m.cost(8, cells=1064), 4)   # 8 tokens x 1000 extra cells x 1 us
0.032
>>> m = DecodeCostModel({1: 0.010, 2: 0.016})
>>> for _ in range(100): m.observe(1, 0.008)   # the machine got 20% faster
>>> round(m.cost(2) / m.cost(1), 2)           # a 2-row verify still costs 1.6x a 1-row decode
1.6
"""

from __future__ import annotations

import bisect
import statistics
import threading
from collections.abc import Callable, Sequence

#: KV cells the calibration's decodes attend (TargetRunner.measure_decode_costs' prefix)
CALIBRATION_PREFIX = 64


def paired_decode_costs(sizes: Sequence[int], reps: int, timed: Callable[[int], float]) -> dict[int, float]:
    """Seconds per decode by batch size, from `timed(n)` (one decode of n rows, in seconds).

    Each size is timed right after a 1-row decode, `reps` times in alternating size order, and priced
    at the median pair ratio times the median 1-row time. A shared machine's speed drifts within seconds:
    timed size by size, one slow spell would become the table's shape and price every short draft out for
    the run, since a draft never sent is never observed to correct it. A spell scales both halves of a pair;
    the median drops a pair that straddles its edge.

    >>> decodes = []
    >>> def timed(n):   # 10 ms + 5 ms per extra row; the host is 3x slower from the 3rd decode on
    ...     decodes.append(n)
    ...     return (0.010 + 0.005 * (n - 1)) * (3.0 if len(decodes) >= 3 else 1.0)
    >>> table = paired_decode_costs((1, 2, 4), reps=3, timed=timed)
    >>> {n: round(table[n] / table[1], 2) for n in table}   # the shape, spell or not
    {1: 1.0, 2: 1.5, 4: 2.5}
    """
    ones: list[float] = []
    ratios: dict[int, list[float]] = {n: [] for n in sizes if n != 1}
    for r in range(reps):
        for n in (list(ratios) if r % 2 == 0 else list(ratios)[::-1]):
            t1 = timed(1)
            ones.append(t1)
            ratios[n].append(timed(n) / t1)
    if not ones:  # sizes == (1,)
        ones = [timed(1) for _ in range(max(1, reps))]
    base = float(statistics.median(ones))
    return {n: base * float(statistics.median(ratios[n])) if n != 1 else base for n in sizes}


class DecodeCostModel:
    def __init__(self, seconds_by_n: dict[int, float] | None = None, ema: float = 0.05,
                 attn_seconds: float = 0.0, ref_cells: int = 64, speed_ema: float = 0.2,
                 read_seconds: float = 0.0, learn: bool = True,
                 shape_ratios: tuple[float, float] = (1.0, 1.0), tile_attn_seconds: float = 0.0,
                 subtile_attn_seconds: float = 0.0) -> None:
        """shape_ratios: the first and second decode of a new batch shape over the table's price, to start from
        (a GPU's learnt values, as a cost table of another device is injected; they are learnt from here on).
        tile_attn_seconds: attn_seconds of a decode of the target's attention tile rows or more, where the kernel
        changes (native Context.attention_tile_rows), and subtile_attn_seconds of half as many rows, both at a
        long context (engine/tile_pads.py prices a round padded to the tile with them; 0: not measured)."""
        # a plausible CPU shape until calibrated: 10 ms + 2.5 ms per extra token
        table = seconds_by_n or {1: 0.010, 2: 0.0125, 4: 0.0175, 8: 0.0275, 16: 0.0475, 32: 0.0875}
        self._ns = sorted(table)
        self._secs = [float(table[n]) for n in self._ns]
        self._keep_monotone()
        self._ema = ema
        self._speed_ema = speed_ema
        # the table and the attention coefficient are kept at the speed the model started from; `_speed`
        # (current decode time / that) scales both
        self._speed = 1.0
        self._seen: dict[int, int] = {}  # decodes observed per size: the most seen one anchors the shape
        self._anchor: int | None = None  # that size (ties: the smaller), kept as the counts grow
        self._attn_ref = max(0.0, float(attn_seconds))  # per token per KV cell beyond ref_cells
        # per KV cell in use, for a one-row decode: what a cell nobody attends (an idle slot's cached prompt in one
        # KV pool, computed and masked with flash attention off) costs every decode; a row of several shares it
        self._read_ref = max(0.0, float(read_seconds))
        self._tile_attn_ref = max(0.0, float(tile_attn_seconds))
        self._subtile_attn_ref = max(0.0, float(subtile_attn_seconds))
        self.ref_cells = ref_cells  # cells the table's measurements attended
        # False: the table stays as given (a cost table of another device injected to see what the policy does)
        self.learn = learn
        # decode time over the prediction for the first and the second decode of a new batch shape, and for the
        # later ones: a GPU backend replays a captured graph only while the shape stays (llama.cpp's CUDA graphs
        # run the first decode of a new shape uncaptured and capture on the second), so the two decodes after a
        # change cost more than their size says; on a CPU all three stay near 1
        self._ratio_after = [float(shape_ratios[0]), float(shape_ratios[1])]
        self._ratio_same = 1.0
        self._lock = threading.Lock()

    @property
    def attn_seconds(self) -> float:
        """Seconds per (token x KV cell) beyond ref_cells, at the current speed."""
        return self._speed * self._attn_ref

    @property
    def tile_attn_seconds(self) -> float:
        """Seconds per (token x KV cell) in a decode of the attention tile's rows or more, at the current speed
        (0: not measured)."""
        return self._speed * self._tile_attn_ref

    @property
    def subtile_attn_seconds(self) -> float:
        """Seconds per (token x KV cell) in a decode of half the attention tile's rows at a long context, at the
        current speed (0: not measured)."""
        return self._speed * self._subtile_attn_ref

    @property
    def read_seconds(self) -> float:
        """Seconds per KV cell in use for a one-row decode, at the current speed (0: not measured)."""
        return self._speed * self._read_ref

    @property
    def speed(self) -> float:
        """Current decode time over the time the model started from (1.0: as calibrated)."""
        return self._speed

    @classmethod
    def calibrated(cls, measured: dict) -> DecodeCostModel:
        """From TargetRunner.calibrate_cost()'s answer (possibly through Ray: keys may arrive as strings)."""
        table = {int(n): float(s) for n, s in measured["table"].items()}
        return cls(table, attn_seconds=measured["attn_seconds"], ref_cells=CALIBRATION_PREFIX,
                   read_seconds=measured.get("read_seconds", 0.0),
                   tile_attn_seconds=measured.get("tile_attn_seconds", 0.0),
                   subtile_attn_seconds=measured.get("subtile_attn_seconds", 0.0))

    def copy(self) -> DecodeCostModel:
        """An independent model that starts where this one is (it learns on its own from here)."""
        return DecodeCostModel(self.table(), ema=self._ema, attn_seconds=self.attn_seconds,
                               ref_cells=self.ref_cells, speed_ema=self._speed_ema, read_seconds=self.read_seconds,
                               learn=self.learn, tile_attn_seconds=self.tile_attn_seconds,
                               subtile_attn_seconds=self.subtile_attn_seconds)

    @property
    def shape_change_penalty(self) -> float:
        """What a change of the batch's shape costs beyond decodes of an unchanged shape, as a share of one
        decode's price: the excess of the first two decodes of the new shape (0 on a CPU; on a GPU the first runs
        without a captured graph and the second captures one, so a draft that changes the shape and back can cost
        more decode time than its rows).

        >>> m = DecodeCostModel({1: 0.002, 8: 0.003})
        >>> for _ in range(200):
        ...     m.observe(1, 0.0036, since_change=0)   # the first decode of a new shape: 1.8x
        ...     m.observe(1, 0.0032, since_change=1)   # the second (the graph is captured): 1.6x
        ...     for _ in range(4): m.observe(1, 0.002, since_change=2)
        >>> round(m.shape_change_penalty, 1), round(m.first_decode_penalty, 1)
        (1.4, 0.8)
        >>> round(m.cost(1) * 1e3, 2)   # the table learns decodes as if their shape had been steady
        2.0
        """
        first, second = self._ratio_after
        return max(0.0, (first + second) / self._ratio_same - 2.0) if self._ratio_same > 0 else 0.0

    @property
    def first_decode_penalty(self) -> float:
        """The first decode of a new shape's excess alone (shape_change_penalty's first part)."""
        return max(0.0, self._ratio_after[0] / self._ratio_same - 1.0) if self._ratio_same > 0 else 0.0

    def table(self) -> dict[int, float]:
        """Seconds per decode by batch size, at the current speed."""
        return {n: self._speed * s for n, s in zip(self._ns, self._secs)}

    def cost(self, n: int, cells: float | None = None) -> float:
        """Seconds for one target decode holding n tokens (n >= 1) that attend `cells` KV cells each
        on average (None: as many as at calibration)."""
        return self._speed * (self._table_cost(n) + self._attn(n, cells))

    def costs(self, n0: int, n1: int, cells: float | None = None) -> list[float]:
        """[cost(n, cells) for n in range(n0, n1)], each the same float, in one pass over the table: a round's
        drafts are priced at a run of consecutive sizes, and a call per size cost more than its arithmetic.

        >>> m = DecodeCostModel({1: 0.010, 4: 0.016}, attn_seconds=1e-7)
        >>> m.costs(1, 7, 200.0) == [m.cost(n, 200.0) for n in range(1, 7)]
        True
        """
        ns, secs, speed, attn = self._ns, self._secs, self._speed, self._attn_ref
        beyond = 0.0 if cells is None else max(0.0, cells - self.ref_cells)
        out = []
        size = len(ns)
        i = 0  # the first table size >= n, as _table_cost's bisect finds it (n only grows)
        for n in range(n0, n1):
            while i < size and ns[i] < n:
                i += 1
            if n <= ns[0]:
                t = secs[0] * n / ns[0] if n > 0 else 0.0
            elif i < size and ns[i] == n:
                t = secs[i]
            elif i == size:
                if size == 1:
                    t = secs[0] * n / ns[0]
                else:
                    t = secs[-1] + (secs[-1] - secs[-2]) / (ns[-1] - ns[-2]) * (n - ns[-1])
            else:
                t = secs[i - 1] + (secs[i] - secs[i - 1]) * (n - ns[i - 1]) / (ns[i] - ns[i - 1])
            out.append(speed * (t + (attn * n * beyond if cells is not None and n > 0 else 0.0)))
        return out

    def _attn(self, n: int, cells: float | None) -> float:
        """At the reference speed."""
        if cells is None or n <= 0:
            return 0.0
        return self._attn_ref * n * max(0.0, cells - self.ref_cells)

    def _table_cost(self, n: int) -> float:
        ns, secs = self._ns, self._secs
        if n <= ns[0]:
            return secs[0] * n / ns[0] if n > 0 else 0.0
        i = bisect.bisect_left(ns, n)
        if i < len(ns) and ns[i] == n:
            return secs[i]
        if i >= len(ns):  # extrapolate with the last segment's slope
            if len(ns) == 1:
                return secs[0] * n / ns[0]
            slope = (secs[-1] - secs[-2]) / (ns[-1] - ns[-2])
            return secs[-1] + slope * (n - ns[-1])
        n0, n1, s0, s1 = ns[i - 1], ns[i], secs[i - 1], secs[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    def observe(self, n: int, seconds: float, cells: float | None = None, since_change: int | None = None) -> None:
        """Fold one measured decode into the model: first the speed factor, then the attention coefficient
        (from decodes with a long context) and the table entry, each from what the speed leaves unexplained.
        since_change: decodes of the same shape right before this one (0: the shape just changed; None: not
        known). The first two of a new shape teach the change's penalty; the table and the speed learn them as if
        the shape had been steady, or a draft size (almost always a new shape at one slot) would absorb the
        penalty and then be charged it twice."""
        if n <= 0 or seconds <= 0 or not self.learn:
            return
        with self._lock:
            predicted = self._table_cost(n) + self._attn(n, cells)
            if since_change is not None and predicted > 0:
                r = min(seconds / (self._speed * predicted), 4.0)
                if since_change < 2:
                    self._ratio_after[since_change] += self._ema * (r - self._ratio_after[since_change])
                    seconds *= self._ratio_same / self._ratio_after[since_change]
                else:
                    self._ratio_same += self._ema * (r - self._ratio_same)
            if predicted > 0:
                # clipped: one decode stalled by the host must not reprice every draft
                ratio = min(max(seconds / predicted, 0.75 * self._speed), 1.5 * self._speed)
                self._speed += self._speed_ema * (ratio - self._speed)
            ref = seconds / self._speed  # this decode at the reference speed
            extra = n * (cells - self.ref_cells) if cells is not None else 0.0
            base = self._table_cost(n)
            if extra > 256 * max(1, n) and ref > base:
                # what this decode says the coefficient is; a slower average than the table's, since the
                # table is re-fitted from the same observation below
                implied = (ref - base) / extra
                self._attn_ref += self._ema * 0.5 * (implied - self._attn_ref)
            ref = max(ref - self._attn(n, cells), 0.25 * ref)
            anchor = self._count(n)
            i = bisect.bisect_left(self._ns, n)
            if i < len(self._ns) and self._ns[i] == n:
                if n != anchor:
                    self._secs[i] += self._ema * (ref - self._secs[i])
                    self._keep_monotone(i)
            elif n > self._ns[-1] or len(self._ns) < 64:
                self._ns.insert(i, n)
                self._secs.insert(i, ref)
                self._keep_monotone(i)

    def _count(self, n: int) -> int:
        """One more decode of n rows seen; returns the most seen size (ties: the smaller), which the table keeps
        as it is. The counts only grow, one at a time, so that is the last one or n."""
        seen = self._seen[n] = self._seen.get(n, 0) + 1
        anchor = self._anchor
        if anchor is None or seen > self._seen[anchor] or (seen == self._seen[anchor] and n < anchor):
            anchor = self._anchor = n
        return anchor

    def _keep_monotone(self, changed: int = 0) -> None:
        """A decode of more tokens never costs less, nor more than decoding them in smaller batches (n/n0
        decodes of the smallest size); noise must make it neither. `changed`: the only entry set since the rule
        last held (0: any, the first entry's change moves every bound). The entries before it hold already, and
        past it the pass ends at the first entry it leaves as it was: the same table as a whole pass, without
        walking the whole table every round (tests/unit/test_cost_learning_fast.py holds the two equal)."""
        ns, secs = self._ns, self._secs
        n0, s0 = ns[0], secs[0]
        for j in range(max(1, changed), len(secs)):
            old = secs[j]
            v = secs[j - 1] if old < secs[j - 1] else old
            v = min(v, s0 * ns[j] / n0)
            if v == old and changed > 0 and j > changed:
                return
            secs[j] = v
