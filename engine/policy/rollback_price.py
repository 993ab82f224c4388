"""What a draft costs beyond its rows on a target that rolls its state back by checkpoint.

With checkpoint rollback (rollback.py) every verify carrying a draft first
saves the sequence's recurrent state, and one rejected in part restores it
and decodes the committed rows again in the next round. The planner charges
a draft, as a fixed cost of sending one at all (planner.plan_draft_lengths'
extra_seconds), the save plus the chance of a rollback times its restore and
replayed rows, all learnt from live rounds as the decode's cost is. In the
other modes a draft costs nothing beyond its rows: a KV cache is trimmed for
free, and llama.cpp's snapshots are written by every decode, drafted or not
(their cost is in the decode's, which calibration measures on that context).

>>> from specray.engine.rollback import RollbackStats
>>> p = RollbackPrice("checkpoint")
>>> round(p.fixed_seconds(0.001) * 1e3, 3)   # before any round: a rollback every time, replaying 2 rows
2.0
>>> p.observe(RollbackStats(verifies=4, rollbacks=2, saves=4, save_seconds=4e-4, restores=2, restore_seconds=6e-4,
...                         replay_rows=6))
>>> round(p.fixed_seconds(0.001) * 1e3, 3)   # 0.1 ms save + half the time (0.3 ms restore + 3 rows of 1 ms)
1.75
>>> round(p.fixed_seconds(0.001, pending=4) * 1e3, 3)   # 4 rows already waiting are replayed again if it fails
3.75
>>> RollbackPrice("snapshots").fixed_seconds(0.001)
0.0
"""

from __future__ import annotations

from ..rollback import RollbackStats

#: weight of a round's measurement in the running means (a few dozen rounds of memory)
ALPHA = 0.05


def _mean(old: float, new: float, first: bool) -> float:
    return new if first else old + ALPHA * (new - old)


class RollbackPrice:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        # priors until rounds teach them: nothing for the copies, every draft rolled back, 2 rows replayed
        self.save_seconds = 0.0
        self.restore_seconds = 0.0
        self.p_rollback = 1.0
        self.replay_rows = 2.0
        self._seen_save = self._seen_verify = self._seen_restore = False

    def observe(self, d: RollbackStats | None) -> None:
        """One round's rollback work (StepOutput.rollback)."""
        if d is None or self.mode != "checkpoint":
            return
        if d.saves:
            self.save_seconds = _mean(self.save_seconds, d.save_seconds / d.saves, not self._seen_save)
            self._seen_save = True
        if d.verifies:
            self.p_rollback = _mean(self.p_rollback, d.rollbacks / d.verifies, not self._seen_verify)
            self._seen_verify = True
        if d.restores:
            self.restore_seconds = _mean(self.restore_seconds, d.restore_seconds / d.restores, not self._seen_restore)
            self.replay_rows = _mean(self.replay_rows, d.replay_rows / d.restores, not self._seen_restore)
            self._seen_restore = True

    def fixed_seconds(self, row_seconds: float, pending: int = 0) -> float:
        """Expected seconds a sequence pays for sending a draft at all: `row_seconds` prices one more row of a
        decode, `pending` rows it already replays (a rollback takes them back again)."""
        if self.mode != "checkpoint":
            return 0.0
        replay = (pending + self.replay_rows) * max(0.0, row_seconds)
        return self.save_seconds + self.p_rollback * (self.restore_seconds + replay)

    def fixed_list(self, price, base_rows: int, pending: list[int]) -> list[float] | None:
        """fixed_seconds for each decoding sequence (`pending`: its replay rows), a row priced at the margin of
        `price(n)` (seconds of an n-row decode) past `base_rows`; None where drafts cost only their rows."""
        if self.mode != "checkpoint":
            return None
        row = price(base_rows + 1) - price(base_rows)
        return [self.fixed_seconds(row, n) for n in pending]

    def to_dict(self) -> dict:
        return {"mode": self.mode, "save_ms": self.save_seconds * 1e3, "restore_ms": self.restore_seconds * 1e3,
                "p_rollback": self.p_rollback, "replay_rows": self.replay_rows}
