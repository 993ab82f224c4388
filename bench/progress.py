"""Progress of a long `specray bench` run on stderr: prompt runs done out of all, elapsed time and an ETA,
at most one line every few seconds (and one at the end of each category)."""

from __future__ import annotations

import time
from collections.abc import Callable


def clock_text(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on.

    >>> clock_text(65.4), clock_text(3 * 3600 + 125)
    ('1:05', '3:02:05')
    """
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def progress_line(done: int, total: int, elapsed: float, where: str = "") -> str:
    """One progress line. The ETA assumes the runs left take as long on average as those done (prompts of
    one category are alike in length, the categories are not: it settles as categories go by).

    >>> progress_line(12, 48, 65.0, "coding")
    'bench: 12/48 prompt runs (25%), elapsed 1:05, ETA 3:15 [coding]'
    >>> progress_line(0, 48, 2.0)
    'bench: 0/48 prompt runs (0%), elapsed 0:02, ETA ?'
    """
    eta = clock_text(elapsed * (total - done) / done) if done else "?"
    pct = 100 * done // total if total else 100
    line = f"bench: {done}/{total} prompt runs ({pct}%), elapsed {clock_text(elapsed)}, ETA {eta}"
    return f"{line} [{where}]" if where else line


class Progress:
    """Counts prompt runs (a prompt through one configuration, in one pass) against `total`: `update` emits
    a progress line when `every` seconds have passed since the last one, `report` at once.

    >>> t = [0.0]; lines = []
    >>> p = Progress(10, lines.append, every=5.0, clock=lambda: t[0])
    >>> t[0] = 1.0; p.update(lambda: 2)          # too soon: the count is not even taken
    >>> t[0] = 6.0; p.update(lambda: 3, "qa")
    >>> t[0] = 7.0; p.report(5, "qa")
    >>> print("\\n".join(lines))
    bench: 3/10 prompt runs (30%), elapsed 0:06, ETA 0:14 [qa]
    bench: 5/10 prompt runs (50%), elapsed 0:07, ETA 0:07 [qa]
    """

    def __init__(self, total: int, emit: Callable[[str], None], every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.emit, self.every, self.clock = total, emit, every, clock
        self.start = self.last = clock()

    def update(self, done: Callable[[], int], where: str = "") -> None:
        """A line if one is due. `done` is called only then: it may count over every running sequence,
        and this runs after every scheduler round."""
        if self.clock() - self.last >= self.every:
            self.report(done(), where)

    def report(self, done: int, where: str = "") -> None:
        """A line now (e.g. at the end of a category)."""
        self.last = self.clock()
        self.emit(progress_line(done, self.total, self.last - self.start, where))

    def ticker(self, done_before: int, runs, where: str) -> Callable[[], None]:
        """An `on_round` callback for a group's runs (lockstep.ConfigRun / LlamaRun): prompt runs done are
        `done_before` plus what `runs` have finished so far."""
        runs = list(runs)
        return lambda: self.update(lambda: done_before + sum(r.done for r in runs), where)
