"""What the draft planner prices a round at, and what each round teaches the prices.

A round costs the target's decode (DecodeCostModel: by batch size, context
and the machine's speed; more right after the batch's shape changed, where a
GPU backend must capture a new graph) plus the host's work (HostCostModel:
per round, per decoding sequence and per draft row). On a CPU the decode is
nearly all of it; on a GPU a small model's short decode makes the host's
share decide whether a draft row pays.

>>> from specray.engine.cost import DecodeCostModel
>>> p = RoundPricer(DecodeCostModel({1: 0.0016, 2: 0.0025, 8: 0.0025}, learn=False))
>>> for _ in range(64): p.host.observe(1, 0, 0.0004)   # 0.4 ms of host work a round
>>> round(p.price(1, 1, 1, None) * 1e3, 2), round(p.price(3, 1, 1, None) * 1e3, 2)   # plain, 2 draft rows
(2.0, 2.9)
"""

from __future__ import annotations

from ..cost import DecodeCostModel
from .host_cost import HostCostModel


class RoundPricer:
    def __init__(self, cost: DecodeCostModel) -> None:
        self.cost = cost
        self.host = HostCostModel()
        self.last_shape = 0  # rows of the last decode
        self.since_change = 0  # decodes of last_shape before the next one (DecodeCostModel.observe's since_change)

    def price(self, n_rows: int, base_rows: int, n_decoding: int, cells: float | None) -> float:
        """Seconds of a round whose target batch holds n_rows, base_rows of them without drafts: the decode, the
        host's work for the round, its sequences and each draft row, and what changing the batch's shape costs
        (DecodeCostModel.shape_change_penalty, ~0 on a CPU): a draft round off the plain shape pays its own
        decode's share, and the way back to the plain shape (two decodes of it upset); a plain round after a draft
        pays the way back too, so a run of drafts of one shape is not charged again for it. What the draft
        planner maximises tokens per second against.

        >>> from specray.engine.cost import DecodeCostModel
        >>> # CUDA graphs: a new shape's first decode runs uncaptured (1.8x), the second captures (1.6x)
        >>> p = RoundPricer(DecodeCostModel({1: 0.0015, 4: 0.0017}, learn=False, shape_ratios=(1.8, 1.6)))
        >>> p.last_shape = 1
        >>> [round(p.price(n, 1, 1, None) * 1e3, 2) for n in (1, 4)]   # steady plain, a 3-token draft
        [1.5, 5.16]
        """
        decode = self.cost.cost(n_rows, cells)
        pen = self.cost.shape_change_penalty
        if pen > 0:
            if n_rows != base_rows:  # off the plain shape, and back to it afterwards
                own = self.cost.first_decode_penalty if n_rows != self.last_shape else 0.0
                decode += own * self.cost.cost(n_rows, cells) + pen * self.cost.cost(base_rows, cells)
            elif n_rows != self.last_shape:
                decode += pen * self.cost.cost(n_rows, cells)
        return decode + self.host.round_seconds(n_decoding, max(0, n_rows - base_rows))

    def prices(self, n0: int, n1: int, base_rows: int, n_decoding: int, cells: float | None) -> list[float]:
        """[price(n, base_rows, n_decoding, cells) for n in range(n0, n1)], each the same float, in one pass
        (DecodeCostModel.costs): the planner prices a round at a run of consecutive sizes.

        >>> from specray.engine.cost import DecodeCostModel
        >>> p = RoundPricer(DecodeCostModel({1: 0.0015, 4: 0.0017}, learn=False, shape_ratios=(1.8, 1.6)))
        >>> p.last_shape = 2
        >>> p.prices(1, 9, 2, 2, 300.0) == [p.price(n, 2, 2, 300.0) for n in range(1, 9)]
        True
        """
        decodes = self.cost.costs(n0, n1, cells)
        pen = self.cost.shape_change_penalty
        if pen > 0:
            first, last = self.cost.first_decode_penalty, self.last_shape
            base = self.cost.cost(base_rows, cells)
            for j, n in enumerate(range(n0, n1)):
                if n != base_rows:
                    own = first if n != last else 0.0
                    decodes[j] += own * decodes[j] + pen * base
                elif n != last:
                    decodes[j] += pen * decodes[j]
        a, b, c, _ = self.host.coefficients()
        fixed = a + b * n_decoding
        return [d + (fixed + c * max(0, n - base_rows)) for d, n in zip(decodes, range(n0, n1))]

    def _shape(self, size: int) -> int:
        """Record a decode of `size` rows; returns how many of that shape came right before it."""
        self.since_change = self.since_change + 1 if size == self.last_shape else 0
        self.last_shape = size
        return self.since_change

    def observe(self, batch_sizes: list[int], decode_seconds: float, cells: float | None, prefill: bool,
                n_decoding: int, n_drafted: int, host_seconds: float, n_emitted: int | None = None) -> None:
        """A round ran: its decodes (sizes, seconds), its host time (wall minus decode) and the tokens it emitted."""
        if prefill:
            # the table prices verify rows, each with a logits row; prompt rows have none (a large vocabulary's
            # output layer is a big share of a row: Gemma's 262k), so a prefill round would underprice them;
            # nor is prompt bookkeeping a round's host work to price. Its shape counts all the same.
            for size in batch_sizes:
                self._shape(size)
            return
        for size in batch_sizes:  # one observation per decode; split rounds attribute time evenly
            since = self._shape(size)
            self.cost.observe(size, decode_seconds / max(1, len(batch_sizes)), cells, since_change=min(since, 2))
        if n_decoding:
            self.host.observe(n_decoding, n_drafted, host_seconds, n_emitted)
