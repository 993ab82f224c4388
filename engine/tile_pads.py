"""Pad rows that put a round's decode on the target's tiled attention kernel, where that makes it cheaper.

llama.cpp's CPU flash attention takes each query row alone over every KV cell until a decode holds the rows of
its tile (native Context.attention_tile_rows); from there it runs a GEMM per tile of query rows and KV cells,
several times cheaper per row and cell. So at a long context a round of a few dozen rows, such as an agent's
next turn (its new message prefilled after thousands of cached tokens, beside the other slots' verify rows),
costs more than the same round padded to the tile: the pad rows add the weights' work of a row each, the tile
takes most of the attention's away.

A pad row repeats its carrier's last token at the positions after the carrier's rows, asks for no output, and
its cells are dropped right after the decode (TargetRunner), so nothing it computes is read. Each row still
attends the cells it would have without the pads, so output is what the unpadded round gives, up to the two
kernels' rounding: fast mode's near-ties, as any change of batch shape gives.

Both prices come from the cost model, whose start-up calibration times both kernels at one long context: the
unpadded round at the below-tile attention price per (row x cell it attends), the padded one at the tile's
price for every row of the tile over the cells the round's sequences hold (a tile of several sequences' rows
computes the union of their cells). Each is then corrected by what the rounds priced with it measured
(KernelFit): a kernel's cost per row and cell moves with the context, and rounds run at other contexts than
the calibration's.

>>> from specray.engine.cost import DecodeCostModel
>>> cost = DecodeCostModel({1: 0.010, 32: 0.100}, attn_seconds=6e-6, tile_attn_seconds=2e-6)
>>> later_turn = StepItem(0, np.zeros(50, np.int32), 1700, sample=False)   # 50 new prompt rows after 1,700
>>> verifies = [StepItem(s, np.zeros(2, np.int32), 1750, n_draft=1) for s in (1, 2, 3)]
>>> items = [later_turn, *verifies]
>>> tile_pad(items, {0: 500, 1: 100, 2: 100, 3: 100}, union_cells=2300, tile=64, cost=cost)[0]  # 8 rows on slot 0
(0, 8)
>>> tile_pad(verifies, {1: 100, 2: 100, 3: 100}, union_cells=2300, tile=64, cost=cost)[0] is None   # 6 rows: no
True
>>> tile_pad(items, {0: 5, 1: 5, 2: 5, 3: 5}, union_cells=2300, tile=64, cost=cost)[0] is None   # no room for 8
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .cost import DecodeCostModel
from .target import StepItem

#: pad only where the padded round's price is at most this share of the unpadded one's: the prices rest on
#: measurements of a noisy machine, and a pad that gains nothing costs its rows' cells for a moment
TILE_PAD_MARGIN = 0.95

#: rounds whose rows attend fewer cells than this on average teach KernelFit nothing: there both prices are
#: mostly the rows' weights, and say little of the attention kernels
MIN_FIT_CELLS = 256


@dataclass
class TileQuote:
    """A round's decode priced before it runs, to learn from its measured time (KernelFit): whether it runs
    the tile kernel, and its price at the start-up slopes."""

    tiled: bool
    seconds: float


@dataclass
class KernelFit:
    """Each kernel's measured over quoted decode time, an exponential average from 1. The start-up slopes are
    taken at one context, and a kernel's cost per row and cell moves with the context (a KV cache too large
    for the CPU's caches is read again for each row below the tile, once per tile of rows on it), so the rounds
    quoted teach how far off they are where rounds run.

    >>> fit = KernelFit()
    >>> for _ in range(30): fit.observe(TileQuote(False, 0.40), 0.70)   # below the tile: 1.75x its quote
    >>> round(fit.below, 2), fit.tile
    (1.75, 1.0)
    """

    below: float = 1.0
    tile: float = 1.0
    ema: float = 0.2

    def observe(self, quote: TileQuote, seconds: float) -> None:
        if quote.seconds <= 0.0 or seconds <= 0.0:
            return
        r = min(max(seconds / quote.seconds, 0.25), 4.0)  # one decode stalled by the host must not swing it
        if quote.tiled:
            self.tile += self.ema * (r - self.tile)
        else:
            self.below += self.ema * (r - self.below)


def round_prices(rows: int, token_cells: float, union_cells: float, tile: int,
                 cost: DecodeCostModel) -> tuple[float, float]:
    """(seconds of a decode of `rows` rows attending `token_cells` (row x cell) in all with the below-tile
    kernel, seconds of a decode of max(rows, tile) rows with the tile kernel, every row over `union_cells`
    cells).

    >>> from specray.engine.cost import DecodeCostModel
    >>> cost = DecodeCostModel({1: 0.010, 64: 0.200}, attn_seconds=6e-6, ref_cells=64, tile_attn_seconds=2e-6)
    >>> [round(p, 3) for p in round_prices(56, 56 * 1750, 2300, 64, cost)]
    [0.742, 0.486]
    """
    ref = cost.ref_cells
    below = cost.subtile_attn_seconds or cost.attn_seconds  # measured at a long context where there is a tile
    n = max(rows, tile)
    unpadded = cost.cost(rows) + below * max(0.0, token_cells - rows * ref)
    tiled = cost.cost(n) + cost.tile_attn_seconds * n * max(0.0, union_cells - ref)
    return unpadded, tiled


def tile_pad(items: list[StepItem], room: dict[int, int] | Callable[[], dict[int, int]],
             union_cells: float | None | Callable[[], float | None], tile: int, cost: DecodeCostModel,
             fit: KernelFit | None = None,
             margin: float = TILE_PAD_MARGIN) -> tuple[tuple[int, int] | None, TileQuote | None]:
    """(carrier's sequence id, pad rows) that bring the round's `items` to `tile` rows where the padded round
    is priced below `margin` x the unpadded one, None where it is not or where no item can carry them; and the
    round's quote for `fit` to learn from (None for a round it says nothing of: a short context, few rows, or
    a round of twice the tile or more). Prices are the start-up slopes' times `fit`'s factors.

    room: per sequence id, the positions it may still fill after its rows of this round (its KV reservation
    and its context). union_cells: cells the round's sequences hold after its rows (None: not known, so each
    sequence's counted whole). Either may be a function that gives it, called only for a round that needs it:
    most rounds (a few verify rows) are ruled out by their rows and contexts alone, every round, on the round
    thread. A carrier is an item of plain rows: no draft tree, replayed rows, hidden-row taps or context shift;
    the one with the most rows is taken (its context is the one the tile reads anyway).
    """
    rows = sum(len(it.tokens) for it in items)
    # under a quarter of the tile, the tile's rows' weights alone cost more than the attention could save
    if not items or rows >= 2 * tile or (rows < tile and 4 * rows < tile) or cost.tile_attn_seconds <= 0.0:
        return None, None
    token_cells = sum(len(it.tokens) * (it.pos0 + len(it.tokens) / 2) for it in items)
    if token_cells < MIN_FIT_CELLS * rows:
        return None, None
    fit = fit or KernelFit()
    union_cells = union_cells() if callable(union_cells) else union_cells
    if union_cells is None:
        union_cells = sum(it.pos0 + len(it.tokens) for it in items)
    pad = max(0, tile - rows)
    unpadded, padded = round_prices(rows, token_cells, union_cells + pad, tile, cost)
    if rows >= tile:  # the tile kernel runs anyway: its time teaches the tile's factor
        return None, TileQuote(True, padded)
    quote = TileQuote(False, unpadded)
    if fit.tile * padded > margin * fit.below * unpadded:
        return None, quote
    room = room() if callable(room) else room
    carriers = [it for it in items if it.tree is None and not it.n_replay and not it.hidden and it.shift is None
                and room.get(it.seq_id, 0) >= pad]
    if not carriers:
        return None, quote
    carrier = max(carriers, key=lambda it: (len(it.tokens), -it.seq_id))
    return (carrier.seq_id, pad), TileQuote(True, padded)
