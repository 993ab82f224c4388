"""The threads that have run a llama.cpp decode in this process: there should be one.

This llama.cpp build runs its CPU threads through OpenMP (libgomp). libgomp
keeps a pool of worker threads for each thread that starts a parallel region
(each thread that calls llama_decode), and the idle workers of every pool
still count as threads it manages. Once a process manages more threads than
it has CPUs, libgomp throttles the spin-wait at its barriers (to 100 spins
from 300,000): the workers sleep between the graph's operations and every
decode pays their wake-ups. So a process that decoded on one thread and then
decodes on another, while the first is still alive, decodes far slower with
2+ threads. Measured on 2 cores, SmolLM2, 2 threads, plain decoding: 91 tok/s
when one thread does all decodes, 50 tok/s when a thread that decoded once
(the engine's set-up) stays alive while another decodes the rounds; a Serve
replica did exactly that (built the engine on the actor's init thread, then
decoded on its round thread): its decode took 21 ms a round against 11 ms in
process.

`note()` is called by Context.decode whenever the calling thread differs from
the last one; `live()` names the live threads that have decoded (the served
stats report how many). A second live one is logged once as a warning.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("specray.native")

#: ident of the thread that ran the last decode (Context.decode compares, then calls note() on a change)
last_ident: int | None = None

_lock = threading.Lock()
_threads: dict[int, threading.Thread] = {}
_warned = False


def note() -> None:
    """Record the calling thread as one that decodes."""
    global last_ident, _warned
    t = threading.current_thread()
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


def live() -> list[str]:
    """Names of the live threads that have run a decode in this process."""
    with _lock:
        return _live_locked()


def _live_locked() -> list[str]:
    for ident in [i for i, t in _threads.items() if not t.is_alive()]:
        del _threads[ident]
    return [t.name for t in _threads.values()]
