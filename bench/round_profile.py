"""`specray bench --profile PATH`: cProfile over the rounds the bench measures, one profile per configuration,
summed over categories and passes, written as a plain-text summary.

Only the timed rounds are profiled (ConfigRun.step: the scheduler's round, i.e. drafting, the target decode,
verification and bookkeeping), not model loading, calibration, the tie-bound probes or the llama_cpp
reference row. llama.cpp's C functions are called through ctypes and are no Python frames of their own:
llama_decode's time is the own time of native/context.py's Context.launch, the one function that calls it
(Context.decode, and an overlapped round's launch, go through it); the summary puts that figure next to
everything else a round costs on the host.
"""

from __future__ import annotations

import ast
import cProfile
import os
import pstats
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the function whose own time is llama_decode's (path relative to the package root, qualified name)
DECODE_FUNCTION = ("native/context.py", "Context.launch")
TOP = 30


#: under --host-replay the target's decode is bench/host_replay.py's stand-in: its whole time (the table's wait
#: and the logits rows it fills) is the decode's
REPLAY_DECODE_FUNCTION = ("bench/host_replay.py", "ReplayDecode.__call__")


class RoundProfiler:
    """A cProfile.Profile per configuration, switched on for the duration of each measured round.
    `replayed`: the rounds run on the host replay's stand-in decode (its cumulative time is the decode's)."""

    def __init__(self, replayed: bool = False) -> None:
        self.replayed = replayed
        self.profiles: dict[str, cProfile.Profile] = {}
        self.rounds: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall time inside the profiled rounds

    @contextmanager
    def round(self, config: str) -> Iterator[None]:
        prof = self.profiles.setdefault(config, cProfile.Profile())
        t0 = time.perf_counter()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            self.seconds[config] = self.seconds.get(config, 0.0) + time.perf_counter() - t0
            self.rounds[config] = self.rounds.get(config, 0) + 1

    def summary(self, top: int = TOP) -> str:
        if self.replayed:
            how = ["or the recording pass. Host replay: the decode is the whole time of "
                   f"{REPLAY_DECODE_FUNCTION[1]} ({REPLAY_DECODE_FUNCTION[0]}),",
                   "the table's wait and the logits rows it fills; the top lists leave that wait out."]
        else:
            how = ["or the llama_cpp reference row. llama_decode is C code called through ctypes: its time is the own",
                   f"time of {DECODE_FUNCTION[1]} ({DECODE_FUNCTION[0]}), the one function that calls it."]
        lines = [
            "specray bench --profile: where the measured rounds' time goes (cProfile, wall time).",
            "Only the rounds the bench times are profiled: not model loading, calibration, the tie-bound probes",
            *how,
            "cProfile slows Python code down: the host figures are upper bounds, and this run's tok/s are not",
            "comparable with an unprofiled run's.",
            "",
            f"{'config':<34}{'rounds':>8}{'seconds':>9}{'ms/round':>10}{'decode ms':>11}{'host ms':>9}",
        ]
        tables = {c: _entries(pstats.Stats(p)) for c, p in self.profiles.items()}
        for c, entries in tables.items():
            n, secs = self.rounds[c], self.seconds[c]
            dec = decode_seconds(entries, self.replayed)
            lines.append(f"{c:<34}{n:>8}{secs:>9.2f}{1000 * secs / n:>10.2f}{1000 * dec / n:>11.2f}"
                         f"{1000 * (secs - dec) / n:>9.2f}")
        total_rounds, total_s = sum(self.rounds.values()), sum(self.seconds.values())
        lines.append(f"{'all':<34}{total_rounds:>8}{total_s:>9.2f}")
        lines.append(f"(decode ms: {'the replayed decode' if self.replayed else 'llama_decode'} per round; host ms: "
                     "everything else in the round, per round)")
        for c, entries in tables.items():
            lines.extend(config_section(c, entries, self.rounds[c], self.seconds[c], top, self.replayed))
        return "\n".join(lines) + "\n"

    def write(self, path: str, top: int = TOP) -> None:
        with open(path, "w") as f:
            f.write(self.summary(top))


# an entry: (own seconds, cumulative seconds, calls, label)
Entry = tuple[float, float, int, str]


def _entries(stats: pstats.Stats) -> list[Entry]:
    out = []
    for key, (_cc, nc, tt, ct, callers) in stats.stats.items():
        # what the host replay's busy wait calls (perf_counter, a million times) is the wait's, not the host's
        for caller, (_ccc, cnc, ctt, cct) in callers.items():
            if caller[0].endswith(os.path.join(*REPLAY_DECODE_FUNCTION[0].split("/"))) and caller[2] == "spin":
                nc, tt, ct = nc - cnc, tt - ctt, ct - cct
        out.append((tt, ct, nc, function_label(key)))
    return out


def _in_replay_wait(e: Entry) -> bool:
    """The host replay's stand-in decode and its busy wait (whose perf_counter calls swamp the host's own)."""
    label = e[3]
    return label.startswith(REPLAY_DECODE_FUNCTION[0] + ":") and (label.endswith(" spin") or
                                                                label.endswith(" " + REPLAY_DECODE_FUNCTION[1]))


def decode_seconds(entries: list[Entry], replayed: bool = False) -> float:
    """llama_decode's seconds: the own time of the function that calls it; with `replayed`, the whole time of the
    host replay's stand-in decode.

    >>> decode_seconds([(0.9, 1.0, 10, "native/context.py:94 Context.launch"), (0.1, 2.0, 10, "x.py:1 f")])
    0.9
    >>> decode_seconds([(0.1, 2.5, 10, "bench/host_replay.py:94 ReplayDecode.__call__")], replayed=True)
    2.5
    """
    path, name = REPLAY_DECODE_FUNCTION if replayed else DECODE_FUNCTION
    col = 1 if replayed else 0
    return sum(e[col] for e in entries if e[3].startswith(path + ":") and e[3].endswith(" " + name))


def config_section(config: str, entries: list[Entry], rounds: int, seconds: float, top: int,
                   replayed: bool = False) -> list[str]:
    """One configuration's part of the summary: its totals, then its top functions by own and by cumulative
    time, each with its share of the rounds' wall time and its milliseconds per round."""
    dec = decode_seconds(entries, replayed)
    if replayed:  # the wait is the decode's: the top lists show the host's functions
        entries = [e for e in entries if not _in_replay_wait(e)]
    pct = 100.0 / seconds if seconds else 0.0
    out = ["", f"== {config}: {rounds} rounds, {seconds:.3f} s profiled ({1000 * seconds / rounds:.2f} ms/round) ==",
           f"{'replayed decode' if replayed else 'llama_decode'}: {dec:.3f} s ({dec * pct:.0f}%, {1000 * dec / rounds:.2f} ms/round); everything else: "
           f"{seconds - dec:.3f} s ({(seconds - dec) * pct:.0f}%, {1000 * (seconds - dec) / rounds:.2f} ms/round)"]
    for title, col in (("own", 0), ("cumulative", 1)):
        out.append(f"\n-- top {top} by {title} time --")
        out.append(f"{'seconds':>9}{'%':>7}{'ms/round':>10}{'calls':>9}  function")
        for e in sorted(entries, key=lambda e: e[col], reverse=True)[:top]:
            out.append(f"{e[col]:>9.3f}{e[col] * pct:>7.1f}{1000 * e[col] / rounds:>10.3f}{e[2]:>9}  {e[3]}")
    return out


def function_label(key: tuple[str, int, str], root: str = REPO_ROOT) -> str:
    """A profile entry's function as `path:line Class.name`, the path relative to specray's root, to
    site-packages or to the standard library; built-ins as cProfile names them.

    >>> function_label(("~", 0, "<built-in method time.perf_counter>"))
    '<built-in method time.perf_counter>'
    >>> function_label(("/w/.venv/lib/python3.11/site-packages/numpy/_core/fromnumeric.py", 10, "argmax"), "/w")
    'numpy/_core/fromnumeric.py:10 argmax'
    """
    path, line, name = key
    if path == "~":
        return name
    short = path
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    if "site-packages" + os.sep in path:  # before the root: a virtual environment may lie inside it
        short = path.split("site-packages" + os.sep, 1)[1]
    elif path.startswith(root + os.sep):
        short = os.path.relpath(path, root)
        name = _qualname(path, line, name)
    elif path.startswith(stdlib):
        short = path[len(stdlib):]
    return f"{short}:{line} {name}"


@lru_cache(maxsize=None)
def _tree(path: str) -> ast.Module | None:
    try:
        with open(path) as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _qualname(path: str, line: int, name: str) -> str:
    tree = _tree(path)
    return qualname_at(tree, line, name) if tree is not None else name


def qualname_at(tree: ast.AST, line: int, name: str) -> str:
    """The qualified name of the function `name` that starts at `line` (its `def` or its first decorator, as
    a code object counts it); `name` itself if none does.

    >>> tree = ast.parse("class A:\\n    @property\\n    def step(self):\\n        pass\\n")
    >>> qualname_at(tree, 2, "step"), qualname_at(tree, 9, "step")
    ('A.step', 'step')
    """
    def walk(node: ast.AST, prefix: str) -> str | None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                starts = {child.lineno} | {d.lineno for d in child.decorator_list[:1]}
                if child.name == name and line in starts and not isinstance(child, ast.ClassDef):
                    return prefix + child.name
                found = walk(child, prefix + child.name + ".")
                if found:
                    return found
        return None

    return walk(tree, "") or name
