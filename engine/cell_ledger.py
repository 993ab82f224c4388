"""KV cells in use in one shared pool (a unified KV cache) when sequences share prefix cells.

llama.cpp's `seq_cp` makes a sequence see another's cells without copying them: after a copy of [0, p) from
slot A to slot B, those p cells hold both sequence ids and are freed only when neither holds them. Counting
every slot's cells would count them twice (and refuse admissions for room that is there); counting them once
under their first holder would forget them when that holder lets go while B still holds them (and admit
sequences the pool has no room for: a failed decode).

The ledger counts them as llama.cpp does. Cells are written in *runs*: a slot prefilling and decoding from
position s writes one run starting at s. A slot holds pieces (run, end): positions [run start, end) of that
run. A copy of [0, p) gives the destination every piece of the source clipped to p. The cells in use are, per
run, from its start to the furthest end any slot holds of it. An active sequence's own run ends at its
reservation (the prompt and every token it may generate), so room for what it has yet to write is counted too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class CellLedger:
    """Which runs of cells each slot holds, and how many cells that makes in all.

    >>> led = CellLedger()
    >>> led.own(0, 0, 1000)          # slot 0 prefills a 900-token prompt and may generate 100
    >>> led.share(1, 0, 800)         # slot 1 copies the first 800 (a shared system prompt) ...
    >>> led.own(1, 800, 1050)        # ... and writes 250 of its own
    >>> led.cells()
    1250
    >>> led.clear(0)                 # slot 0's cache is evicted: slot 1 still holds the 800 it shares
    >>> led.cells()
    1050
    """

    pieces: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # slot -> [(run, end)]
    starts: dict[int, int] = field(default_factory=dict)  # run -> its first position
    _ids: itertools.count = field(default_factory=itertools.count)

    def own(self, slot: int, start: int, end: int) -> None:
        """`slot` keeps what it holds below `start` and writes positions [start, end) itself."""
        self.clip(slot, start)
        if end > start:
            run = next(self._ids)
            self.starts[run] = start
            self.pieces.setdefault(slot, []).append((run, end))

    def share(self, dst: int, src: int, n: int) -> None:
        """`dst` drops its cells and sees `src`'s first `n` positions (seq_cp of [0, n))."""
        got = [(r, min(e, n)) for r, e in self.pieces.get(src, []) if self.starts[r] < n]
        self.pieces[dst] = got
        self._forget_unheld()

    def clip(self, slot: int, end: int) -> None:
        """`slot` keeps positions [0, end) only (a cut back to a prefix; 0: all dropped)."""
        kept = [(r, min(e, end)) for r, e in self.pieces.get(slot, []) if self.starts[r] < end]
        if kept:
            self.pieces[slot] = kept
        else:
            self.pieces.pop(slot, None)
        self._forget_unheld()

    def clear(self, slot: int) -> None:
        self.clip(slot, 0)

    def held(self, slot: int) -> int:
        """Positions `slot` holds (its own and shared ones)."""
        return sum(e - self.starts[r] for r, e in self.pieces.get(slot, []))

    def written(self, ends: dict[int, int]) -> int:
        """Cells the slots of `ends` hold below their end positions (what they have written, not what they
        reserve), a cell several of them share counted once.

        >>> led = CellLedger()
        >>> led.own(0, 0, 1000); led.share(1, 0, 800); led.own(1, 800, 1050)
        >>> led.written({0: 900, 1: 850})   # slot 0's 900, slot 1's 800 shared with it and 50 of its own
        950
        """
        furthest: dict[int, int] = {}
        for slot, end in ends.items():
            for r, e in self.pieces.get(slot, []):
                if self.starts[r] < end:
                    furthest[r] = max(furthest.get(r, 0), min(e, end))
        return sum(e - self.starts[r] for r, e in furthest.items())

    def cells(self, without: tuple[int, ...] = ()) -> int:
        """Cells in use (slots in `without` left out: what would remain were they cleared)."""
        furthest: dict[int, int] = {}
        for slot, ps in self.pieces.items():
            if slot in without:
                continue
            for r, e in ps:
                furthest[r] = max(furthest.get(r, 0), e)
        return sum(e - self.starts[r] for r, e in furthest.items())

    def copy(self) -> "CellLedger":
        """An independent ledger with the same holdings (to try a change on)."""
        return CellLedger({s: list(ps) for s, ps in self.pieces.items()}, dict(self.starts), self._ids)

    def without(self, slots: tuple[int, ...]) -> "CellLedger":
        """A copy with `slots` cleared."""
        out = self.copy()
        for s in slots:
            out.clear(s)
        return out

    def _forget_unheld(self) -> None:
        held = {r for ps in self.pieces.values() for r, _ in ps}
        for r in [r for r in self.starts if r not in held]:
            del self.starts[r]
