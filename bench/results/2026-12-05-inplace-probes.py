"""Five things tried against the round's host time in place, each a hook around `specray bench` run in this process
(experiments page, "The round's host time in place, probed"):
- `base`: none (the control);
- `prefetch`: after every decode, a prefetch of libpython's whole code mapping into the L2 cache, from a few lines
  of C built here with gcc, its time added to the round's host time by the reader (`probe.prefetch_seconds`);
- `hugepages`: the process's large anonymous mappings (the KV cache, the compute buffers, the heap) collapsed into
  2 MiB pages (madvise MADV_HUGEPAGE, then MADV_COLLAPSE, 2 MiB at a time) after the 5th, 50th, 300th, 1000th and
  3000th decode; the model's weights stay in llama.cpp's file mapping, which MADV_COLLAPSE refuses (EINVAL);
- `objects`: after every decode, a prefetch of the engine's own objects: breadth first from the scheduler and the
  modules of specray.engine and specray.native through gc.get_referents, level by level up to the level that
  reaches 1,500 objects ($OBJECTS_LIMIT; classes and modules are not walked through, arrays over 4 KiB are not
  walked): each object's first 256 bytes, a dict's key table and a list's item array (their pointers read at
  CPython 3.11's offsets) and a small array's data; the set made again every 300 rounds of the run, from the 50th;
  its time added by the reader (`probe.prefetch_seconds`);
- `objects-in-wait`: the same prefetch in the host replay (`--host-replay`), inside its wait for the simulated
  decode, 0.2 ms before the wait ends, as a host waiting on a GPU could run it (no time of the round's own); each
  scheduler's set made from its own 50th round, and only the running scheduler's prefetched;
- `gc`: the garbage collector's collections, by generation, inside the scheduler's rounds and outside them.
The bench's own JSON goes to the path given with --json; the probe's counters to OUT.json.
    .venv/bin/python bench/results/2026-12-05-inplace-probes.py MODE OUT.json BENCH_ARGS..."""
import atexit
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import types

from specray.engine import scheduler
from specray.native import context

MODE, OUT = sys.argv[1], sys.argv[2]
probe: dict = {"mode": MODE}

PREFETCH_C = r"""
#include <stddef.h>
#include <stdint.h>
void prefetch(uintptr_t start, size_t len) {
    for (const char *p = (const char *)start, *e = p + len; p < e; p += 64) __builtin_prefetch(p, 0, 2);
}
void prefetch_ranges(const uintptr_t *addr, const uint32_t *len, size_t n) {
    for (size_t i = 0; i < n; i++)
        for (const char *p = (const char *)addr[i], *e = p + len[i]; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}
"""


def built_prefetch():
    build = tempfile.mkdtemp()
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", f"{build}/prefetch.so"],
                   input=PREFETCH_C.encode(), check=True)
    lib = ctypes.CDLL(f"{build}/prefetch.so")
    lib.prefetch.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    lib.prefetch_ranges.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def pointer_at(obj, offset: int) -> int:
    return ctypes.c_void_p.from_address(id(obj) + offset).value or 0


def engine_objects(roots: list, limit: int):
    """(addresses, lengths, objects) of what `roots` reach, breadth first, up to the level that reaches `limit`
    objects (`objects` above)."""
    import numpy as np
    seen, order, frontier = set(), [], list(roots)
    while frontier and len(order) < limit:
        nxt = []
        for o in frontier:
            if id(o) in seen:
                continue
            seen.add(id(o))
            order.append(o)
            if isinstance(o, (type, types.ModuleType)) and not any(o is r for r in roots):
                continue
            if isinstance(o, np.ndarray) and o.size > 4096:
                continue
            nxt.extend(gc.get_referents(o))
            nxt.append(type(o))
        frontier = nxt
    addr, length = [], []
    for o in order:
        addr.append(id(o))
        length.append(min(sys.getsizeof(o), 256))
        if isinstance(o, dict) and (keys := pointer_at(o, 32)):  # PyDictObject.ma_keys
            addr.append(keys)
            length.append(min(64 + 48 * len(o), 1024))
        elif isinstance(o, list) and len(o) and (items := pointer_at(o, 24)):  # PyListObject.ob_item
            addr.append(items)
            length.append(min(8 * len(o), 1024))
        elif isinstance(o, np.ndarray) and 0 < o.nbytes <= 4096:
            addr.append(o.ctypes.data)
            length.append(o.nbytes)
    return np.array(addr, dtype=np.uintp), np.array(length, dtype=np.uint32), len(order)


def mappings():
    """(start, end, permissions, path) of this process's mappings."""
    for line in open("/proc/self/maps"):
        f = line.split()
        a, b = (int(x, 16) for x in f[0].split("-"))
        yield a, b, f[1], f[5] if len(f) > 5 else ""


def hook_launch(after):
    launch = context.Context.launch

    def hooked(self, batch=None):
        launch(self, batch)
        after()
    context.Context.launch = hooked


if MODE == "prefetch":
    lib = built_prefetch()
    code = [(a, b - a) for a, b, perm, path in mappings() if "x" in perm and "libpython" in path]
    probe.update(prefetch_kib=sum(n for _, n in code) // 1024, prefetches=0, prefetch_seconds=0.0)

    def prefetch():
        t0 = time.perf_counter()
        for a, n in code:
            lib.prefetch(a, n)
        probe["prefetch_seconds"] += time.perf_counter() - t0
        probe["prefetches"] += 1
    hook_launch(prefetch)
elif MODE in ("objects", "objects-in-wait"):
    lib = built_prefetch()
    ranges: list = []  # [addresses, lengths, the scheduler they were taken from]
    probe.update(objects=0, cache_lines=0, sets_made=0, prefetches=0, prefetch_seconds=0.0)
    step = scheduler.Scheduler.step
    # rounds counted over every scheduler of the run (`objects`), or each scheduler's own (`objects-in-wait`: the
    # replay runs a scheduler per configuration after the real run's, and prefetches only the running one's set)
    rounds: dict = {}
    current = [0]  # the scheduler running

    def remade(self):
        key = id(self) if MODE == "objects-in-wait" else 0
        n = rounds[key] = rounds.get(key, 0) + 1
        if n % 300 == 50:
            mods = [m for k, m in sys.modules.items() if k.startswith(("specray.engine", "specray.native"))]
            addr, length, n_objects = engine_objects([self, *mods], int(os.environ.get("OBJECTS_LIMIT", "1500")))
            ranges[:] = [addr, length, id(self)]
            probe.update(objects=n_objects, cache_lines=int(((length.astype("int64") + 63) // 64).sum()),
                         sets_made=probe["sets_made"] + 1)
        current[0] = id(self)
        return step(self)
    scheduler.Scheduler.step = remade

    def prefetch_objects():
        if ranges and (MODE == "objects" or ranges[2] == current[0]):
            t0 = time.perf_counter()
            lib.prefetch_ranges(ranges[0].ctypes.data, ranges[1].ctypes.data, len(ranges[0]))
            probe["prefetch_seconds"] += time.perf_counter() - t0
            probe["prefetches"] += 1
    if MODE == "objects":
        hook_launch(prefetch_objects)
    else:
        from specray.bench import host_replay

        def logits(self, n_outputs):
            host_replay.spin(self._until - 0.0002 - time.perf_counter())
            prefetch_objects()
            host_replay.spin(self._until - time.perf_counter())
            return self.buf[:n_outputs]
        host_replay.ReplayDecode.logits = logits
elif MODE == "hugepages":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_HUGEPAGE, MADV_COLLAPSE, HUGE = 14, 25, 1 << 21
    probe.update(decodes=0, collapsed_mib=0)

    def collapse():
        probe["decodes"] += 1
        if probe["decodes"] not in (5, 50, 300, 1000, 3000):
            return
        done = 0
        for a, b, perm, path in list(mappings()):
            if path not in ("", "[heap]") or "w" not in perm or b - a < (4 << 20):
                continue
            lo, hi = (a + HUGE - 1) & ~(HUGE - 1), b & ~(HUGE - 1)
            if hi > lo:
                libc.madvise(lo, hi - lo, MADV_HUGEPAGE)
                done += sum(libc.madvise(p, HUGE, MADV_COLLAPSE) == 0 for p in range(lo, hi, HUGE))
        probe["collapsed_mib"] = max(probe["collapsed_mib"], 2 * done)
    hook_launch(collapse)
elif MODE == "gc":
    in_round, started = [False], {}
    probe.update(rounds=0, **{f"{where}_gen{g}": [0, 0.0] for where in ("in_rounds", "outside") for g in range(3)})

    def collected(phase, info):
        key = f"{'in_rounds' if in_round[0] else 'outside'}_gen{info['generation']}"
        if phase == "start":
            started[key] = time.perf_counter()
        else:
            probe[key][0] += 1
            probe[key][1] += time.perf_counter() - started.pop(key)
    gc.callbacks.append(collected)
    step = scheduler.Scheduler.step

    def counted(self):
        probe["rounds"] += 1
        in_round[0] = True
        try:
            return step(self)
        finally:
            in_round[0] = False
    scheduler.Scheduler.step = counted
elif MODE != "base":
    sys.exit(f"unknown MODE {MODE!r}: base, prefetch, objects, objects-in-wait, hugepages or gc")

atexit.register(lambda: json.dump(probe, open(OUT, "w"), indent=1))
from specray.cli.main import main  # noqa: E402  (after the hooks)

main(sys.argv[3:])
