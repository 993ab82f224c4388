"""Two warm pure-Python loops (a dict and a list; small objects made and called), best of 7, under whichever
interpreter runs this: what an interpreter's build does to warm code, against the round's host time in place
(experiments page, "The round's host time in place, probed").
    PY bench/results/2026-12-05-interpreter-loops.py [OUT.json]"""
import json
import sys
import sysconfig
import time


def dict_list():
    d, lst = {}, []
    for i in range(200000):
        d[i & 1023] = d.get(i & 1023, 0) + i
        lst.append(i * 2)
        if len(lst) > 100:
            lst.clear()
    return d


class Pair:
    __slots__ = ("x", "y")

    def __init__(self, x):
        self.x, self.y = x, x + 1

    def total(self):
        return self.x + self.y


def objects():
    t = 0
    for i in range(200000):
        t += Pair(i).total()
    return t


res = {"python": sys.version.split()[0], "executable": sys.executable,
       "config_args": sysconfig.get_config_var("CONFIG_ARGS")}
for fn in (dict_list, objects):
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    res[fn.__name__ + "_ms"] = round(best * 1e3, 1)
print(json.dumps(res))
if len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
