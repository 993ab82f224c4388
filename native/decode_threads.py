"""The threads that have run a llama.cpp decode in this process: there should be one.

This llama.cpp build runs its CPU threads through OpenMP (libgomp). libgomp
keeps a pool of worker threads for each thread that starts a parallel region
(each thread that calls llama_decode), and the idle workers of every pool
still count as threads it manages. Once a process manages more threads than
it has CPUs, libgomp throttles the spin-wait at its barriers (to 100 spins
from 300,000): the workers sleep between the graph's operations and every
decode pays their wake-ups. So a process that decoded on one thread and then
decodes on another, while the first is still alive, decodes far slower with
2+ threads: a Serve replica that builds the engine on the actor's init thread
(the engine's set-up decodes) and then decodes on its round thread would do
exactly that.

`note()` is called by Context.decode whenever the calling thread differs from
the last one; `live()` names the live threads that have decoded (the served
stats report how many). A second live one is logged once as a warning.

`note()` also gives the calling thread the OS name `specray-decode`
(`name_os_thread`, Linux: /proc/self/task/TID/comm). libgomp's workers are
created by that thread at its first parallel region and inherit the name, so
`top -H`, `ps -L` and `specray bench --url` (bench/server_cpu.py) can tell
llama.cpp's decode threads from a serving process's other threads. Ray
renames an actor's executor threads for each task, so the decoding thread
itself is also reported by id (`native_ids()`, in /v1/stats' `decode_tids`);
the workers keep the name. A thread
that sets up llama.cpp before it decodes (the replica's round thread builds
the engine) calls `name_os_thread()` first, so its pool is named too. The
main thread keeps its name (`ps` shows it as the process's): an in-process
engine decoding there is not a serving process.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("specray.native")

#: ident of the thread that ran the last decode (Context.decode compares, then calls note() on a change)
last_ident: int | None = None

#: the OS name (comm) of every thread that decodes, and of libgomp's workers it starts (<= 15 bytes)
OS_THREAD_NAME = "specray-decode"

_lock = threading.Lock()
_threads: dict[int, threading.Thread] = {}
_warned = False


def name_os_thread(name: str = OS_THREAD_NAME) -> bool:
    """Give the calling thread this OS name (Linux; threads it starts later inherit it). False where the
    platform has no /proc/self/task (the name is only for tools to read, so nothing depends on it)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
        return True
    except OSError:
        return False


def note() -> None:
    """Record the calling thread as one that decodes (and name it for the OS: module docstring)."""
    global last_ident, _warned
    t = threading.current_thread()
    if t.ident not in _threads and t is not threading.main_thread():  # the main thread's name is the process's
        name_os_thread()
    with _lock:
        last_ident = t.ident
        _threads[t.ident] = t
        names = _live_locked()
        warn = len(names) > 1 and not _warned
        _warned = _warned or warn
    if warn:
        log.warning("llama.cpp decodes from %d live threads in this process (%s): OpenMP throttles its "
                    "spin-waits and decodes run up to 2x slower; decode from one thread (native/decode_threads.py)",
                    len(names), ", ".join(names))


def native_ids() -> list[int]:
    """OS thread ids of the live threads that have run a decode here (a Ray actor's executor thread is
    renamed by Ray for every task it runs, so bench/server_cpu.py also needs these ids, not only the name)."""
    with _lock:
        _live_locked()
        return sorted(t.native_id for t in _threads.values() if t.native_id is not None)


def live() -> list[str]:
    """Names of the live threads that have run a decode in this process."""
    with _lock:
        return _live_locked()


def _live_locked() -> list[str]:
    for ident in [i for i, t in _threads.items() if not t.is_alive()]:
        del _threads[ident]
    return [t.name for t in _threads.values()]
