"""How long a fixed piece of Python work takes right after the thread busy-waited W ms (benchmarks page, "Host work
after a wait").

The work walks N small objects (an int, a one-entry dict, a 4-list each) in a fixed shuffled order: N = 300 is
about 120 KiB (inside one core's 1 MiB L2), N = 3000 about 1.2 MiB. The wait is a spin on time.perf_counter(),
as a host thread waiting on its GPU stream spins (bench/host_replay.py spin), so the thread itself touches
almost nothing while it waits. Waits are interleaved: each repetition runs every wait once, in a shuffled order.
A second part (N = 300) fills a 25 ms wait three ways: spinning, walking the same objects again and again, and
walking another 300 objects of the same shape (both sets together fit in L2 four times over).

    .venv/bin/python bench/results/2026-12-05-wait-decay.py OUT.json
"""

import json
import platform
import random
import statistics
import sys
import time

WAITS_MS = (0.0, 0.2, 1.0, 1.6, 3.0, 6.0, 10.0, 25.0)
SIZES = (300, 3000)
REPS = 200


class Obj:
    __slots__ = ("a", "b", "c")

    def __init__(self, i):
        self.a, self.b, self.c = i, {i: i}, [i] * 4


def make(n):
    objs = [Obj(i) for i in range(n)]
    order = list(range(n))
    random.Random(0).shuffle(order)

    def work():
        s = 0
        for i in order:
            o = objs[i]
            s += o.a + o.b[o.a] + o.c[2]
        return s

    return work


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def keep_walking(seconds, work):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()


def fills(out_rows):
    work, other = make(300), make(300)
    ways = {"spin": spin, "walk the same objects": lambda s: keep_walking(s, work),
            "walk other objects": lambda s: keep_walking(s, other)}
    for name, wait in ways.items():
        for w in (0.0, 25.0):
            times = []
            for _ in range(REPS):
                wait(w / 1e3)
                t0 = time.perf_counter()
                work()
                times.append(time.perf_counter() - t0)
            med = round(statistics.median(times) * 1e6, 1)
            out_rows.append({"wait": name, "wait_ms": w, "median_us": med})
            print(f"N=  300, {w:4.1f} ms of {name:22}: {med:8.1f} us median", flush=True)


def main(out):
    rng = random.Random(1)
    result = {"command": "bench/results/2026-12-05-wait-decay.py",
              "machine": platform.processor() or platform.machine(), "reps": REPS, "waits_ms": list(WAITS_MS), "by_size": {}}
    for n in SIZES:
        work = make(n)
        for _ in range(20):
            work()
        times = {w: [] for w in WAITS_MS}
        for _ in range(REPS):
            waits = list(WAITS_MS)
            rng.shuffle(waits)
            for w in waits:
                spin(w / 1e3)
                t0 = time.perf_counter()
                work()
                times[w].append(time.perf_counter() - t0)
        rows = {str(w): {"median_us": round(statistics.median(t) * 1e6, 1),
                         "p90_us": round(sorted(t)[int(0.9 * len(t))] * 1e6, 1)} for w, t in times.items()}
        result["by_size"][str(n)] = rows
        base = rows["0.0"]["median_us"]
        for w in WAITS_MS:
            r = rows[str(w)]
            print(f"N={n:5} after {w:5.1f} ms: {r['median_us']:8.1f} us median ({r['median_us'] / base:4.2f}x), "
                  f"p90 {r['p90_us']:8.1f}", flush=True)
    result["fills_n300"] = []
    fills(result["fills_n300"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
