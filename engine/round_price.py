"""What the draft planner prices a round at, and what each round teaches the prices.

A round costs the target's decode (DecodeCostModel: by batch size, context
and the machine's speed; more right after the batch's shape changed, where a
GPU backend must capture a new graph) plus the host's work (HostCostModel:
per round, per decoding sequence and per draft row). On a CPU the decode is
nearly all of it; on a GPU a 1-2 ms decode makes the host's share decide
whether a draft row pays.

>>> from specray.engine.cost import DecodeCostModel
>>> p = RoundPricer(DecodeCostModel({1: 0.0016, 2: 0.0025, 8: 0.0025}, learn=False))
>>> for _ in range(64): p.host.observe(1, 0, 0.0004)   # 0.4 ms of host work a round
>>> round(p.price(1, 1, 1, None) * 1e3, 2), round(p.price(3, 1, 1, None) * 1e3, 2)   # plain, 2 draft rows
(2.0, 2.9)
"""

from __future__ import annotations

from .cost import DecodeCostModel
from .host_cost import HostCostModel


class RoundPricer:
    def __init__(self, cost: DecodeCostModel) -> None:
        self.cost = cost
        self.host = HostCostModel()
        self.last_shape = 0  # rows of the last decode

    def price(self, n_rows: int, base_rows: int, n_decoding: int, cells: float | None) -> float:
        """Seconds of a round whose target batch holds n_rows, base_rows of them without drafts: the decode (more
        if the shape differs from the last decode's, by what such decodes were seen to cost), plus the host's work
        for the round, its sequences and each draft row. What the draft planner maximises tokens per second
        against."""
        decode = self.cost.cost(n_rows, cells)
        if n_rows != self.last_shape:
            decode *= 1.0 + self.cost.shape_change_penalty
        return decode + self.host.round_seconds(n_decoding, max(0, n_rows - base_rows))

    def observe(self, batch_sizes: list[int], decode_seconds: float, cells: float | None, prefill: bool,
                n_decoding: int, n_drafted: int, host_seconds: float, n_emitted: int | None = None) -> None:
        """A round ran: its decodes (sizes, seconds), its host time (wall minus decode) and the tokens it emitted."""
        if prefill:
            # the table prices verify rows, each with a logits row; prompt rows have none (a large vocabulary's
            # output layer is a big share of a row: Gemma's 262k), so a prefill round would underprice them;
            # nor is prompt bookkeeping a round's host work to price
            self.last_shape = batch_sizes[-1] if batch_sizes else self.last_shape
            return
        for size in batch_sizes:  # one observation per decode; split rounds attribute time evenly
            self.cost.observe(size, decode_seconds / max(1, len(batch_sizes)), cells,
                              shape_changed=size != self.last_shape)
            self.last_shape = size
        if n_decoding:
            self.host.observe(n_decoding, n_drafted, host_seconds, n_emitted)
