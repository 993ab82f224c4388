"""CPU time a server on this machine spends per generated token: llama.cpp's decode threads, and the rest.

Wall-clock ratios on a small, shared box move between runs; CPU time per
token moves far less, and it is what the serving path takes from the decode
when both share the cores (docs/serving.md). For a
server reached over loopback, `specray bench --url/--http` reads
/proc/PID/task/*/stat of every process /v1/stats names (engine replicas,
ingress replicas, target and companion actors) before and after a run:
threads named `specray-decode` (native/decode_threads.py: the decoding
thread and libgomp's workers it started) and the threads /v1/stats lists
under `decode_tids` (an actor's decoding thread, which Ray renames for each
task) count as `decode`, every other thread as `other` (event loops, HTTP,
Ray's own threads). A thread that
ended during the run loses its time (none of a served engine's do). Servers
without /v1/stats (llama-server) or elsewhere get no figures.

`ray`: Ray's own processes on this machine that /v1/stats does not name
(GCS, raylet, dashboard and its agents, log monitor, the Serve controller and
proxy, idle workers): they run on the same cores too, request or not
(cluster/ray_env.py).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from specray.native.decode_threads import OS_THREAD_NAME

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _ids(stats: dict | None, key: str, list_key: str) -> list[int]:
    """Every int under `key` and in every list under `list_key`, at any depth of `stats`, sorted, once each."""
    found: set[int] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == key and isinstance(v, int):
                    found.add(v)
                elif k == list_key and isinstance(v, list):
                    found.update(p for p in v if isinstance(p, int))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(stats or {})
    return sorted(found)


def server_pids(stats: dict | None) -> list[int]:
    """Every process id /v1/stats names (keys `pid` and `pids`, at any depth), sorted, once each.

    >>> server_pids({"process": {"pid": 7}, "ingress": {"pids": [7, 9]}, "arms": {"a": {"engine": {"pids": [7]}}},
    ...              "placement": {"target": {"pid": 12}, "companion": {"pid": None}}})
    [7, 9, 12]
    """
    return _ids(stats, "pid", "pids")


def decode_tids(stats: dict | None) -> list[int]:
    """The decoding threads /v1/stats names (`decode_tid` / `decode_tids`, from every process that decodes).

    >>> decode_tids({"target": {"decode_tids": [40]}, "companion": {"decode_tids": [51, 40]}})
    [40, 51]
    """
    return _ids(stats, "decode_tid", "decode_tids")


def stat_seconds(path: str) -> float:
    """User + system CPU seconds of a /proc/PID/stat or /proc/PID/task/TID/stat file (OSError if gone)."""
    with open(path) as f:
        stat = f.read()
    # the name may hold spaces and parentheses: the fields after its last ')' start at field 3 (state), so
    # utime and stime (fields 14 and 15) are the 12th and 13th
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_local(url: str) -> bool:
    """A server this machine's /proc can see (pids from a remote /v1/stats would name local strangers)."""
    return urlsplit(url).hostname in LOOPBACK


def cpu_seconds(pids: list[int], decoding: list[int] = ()) -> dict[str, float]:
    """{"decode": s, "other": s}: user + system CPU so far of the processes' threads; decode: those named
    specray-decode and the thread ids in `decoding`."""
    decoding = {str(t) for t in decoding}
    out = {"decode": 0.0, "other": 0.0}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone, or not on this machine
            continue
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{task}/comm") as f:
                    comm = f.read().strip()
                seconds = stat_seconds(f"{task}/stat")
            except OSError:  # the thread ended between listing and reading
                continue
            out["decode" if comm == OS_THREAD_NAME or tid in decoding else "other"] += seconds
    return out


#: Ray's daemons by /proc/PID/comm; its Python processes are `ray::NAME` or a script of Ray's package
RAY_DAEMONS = ("gcs_server", "raylet")


def is_ray_process(comm: str, argv: list[str]) -> bool:
    """A process of Ray itself: a daemon, a worker or actor (`ray::...`), or one of Ray's own scripts.

    >>> is_ray_process("ray::ServeController", ["ray::ServeController"])
    True
    >>> is_ray_process("python", ["/v/bin/python", "-u", "/v/lib/python3.11/site-packages/ray/_private/log_monitor.py"])
    True
    >>> is_ray_process("specray", ["/v/bin/python", "/v/bin/specray", "serve"])
    False
    """
    if comm.startswith("ray::") or comm in RAY_DAEMONS:
        return True
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return "/site-packages/ray/" in script


def ray_pids(exclude: list[int] = ()) -> list[int]:
    """Every process of Ray on this machine (is_ray_process) but those in `exclude`, sorted."""
    out = []
    skip = set(exclude)
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_ray_process(comm, argv):
            out.append(int(name))
    return sorted(out)


def process_seconds(pids: list[int]) -> float:
    """User + system CPU so far of whole processes (every thread, ended ones too); a gone process counts 0."""
    total = 0.0
    for pid in pids:
        try:
            total += stat_seconds(f"/proc/{pid}/stat")
        except OSError:
            pass
    return total


def per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict | None:
    """Milliseconds of CPU per generated token between two cpu_seconds snapshots; None without tokens.

    >>> per_token({"decode": 1.0, "other": 0.5}, {"decode": 2.5, "other": 0.8}, 1000)
    {'decode_ms_per_token': 1.5, 'other_ms_per_token': 0.3}
    >>> per_token({"decode": 1.0, "other": 0.5, "ray": 2.0}, {"decode": 2.5, "other": 0.8, "ray": 2.1}, 1000)
    {'decode_ms_per_token': 1.5, 'other_ms_per_token': 0.3, 'ray_ms_per_token': 0.1}
    """
    if tokens <= 0:
        return None
    return {f"{k}_ms_per_token": round(1000 * (after[k] - before[k]) / tokens, 3) for k in before if k in after}
