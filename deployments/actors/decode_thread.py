"""One thread for every llama.cpp call of an actor, whichever thread the actor's calls arrive on.

libgomp keeps a worker pool per thread that decodes, and a process with more pool workers than CPUs decodes
markedly slower (native/decode_threads.py). The companion actor's calls arrive on two threads once its
rounds go through a compiled graph: Ray runs a graph's task on a thread of its own, while the set-up (the
draft model's calibration, the heads' probes), inspection calls and the actor-call hop run on the actor's
main thread. So the companion hands each call that touches a context to this one thread. A hand-off costs
two thread wake-ups, far less than the compiled hop saves over an actor call.

>>> import threading
>>> t = DecodeThread("doc-decode")
>>> t.run(lambda: threading.current_thread().name).startswith("doc-decode")
True
>>> t.run(lambda: threading.current_thread().ident) == t.run(lambda: threading.current_thread().ident)
True
>>> t.close()
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class DecodeThread:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the thread, waited for; its exception is raised here."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
