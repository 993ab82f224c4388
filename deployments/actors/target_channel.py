"""The router's compiled-graph links to the target actor (`ServeConfig.target_hop: compiled`) and to the
companion (`companion_hop: compiled`, companion_client.py): any actor with `channel(msg)` and `wake()`.

An actor call submits a task each way, every round. A Ray Compiled Graph (`ray.dag`, `experimental_compile`)
keeps one task running on the actor and passes each round through shared-memory channels, a much shorter hop
for the same payload (docs/serving.md). Two traits of Ray 2.60's channels shape this class:

- A channel read polls (sched_yield) rather than sleeping: the router would spin a core for the whole decode,
  beside llama.cpp's threads. So `call` first sleeps most of what a step with as many rows took inside the
  actor lately (`ExpectedWait`), and reads only then.
- Between executions the actor's graph thread polls its input channel: an idle replica would burn a core for
  as long as it is idle. When the router goes idle it `park`s that thread in a plain wait
  (TargetService.channel) and, on its next round, `wake`s it with one ordinary actor call.

From compile on, the graph's thread is the only one that decodes: calibration goes through it too (llama.cpp's
OpenMP pools are per calling thread, native/decode_threads.py).
"""

from __future__ import annotations

import collections
import time


def resolve_target_hop(setting: str, info: dict) -> str:
    """The hop a replica uses (ServeConfig.target_hop), from the target actor's `info()`: "auto" takes the
    compiled graph where the actor's node has a core its llama.cpp threads leave free, or the target decodes
    on a GPU; there the channels' polling costs nothing the decode needs. Where the threads take every core,
    the polling slows the decode by more than the shorter hop saves, so auto keeps the actor call.
    Hidden-state heads go either way: the target pins the object refs of their rows until the companion has
    read them (row_transport.ObjectStoreTransport), which a graph's channel, unlike an actor call's return,
    does not do for it.

    >>> resolve_target_hop("auto", {"cpus": 2, "threads": 2, "n_gpu_layers": 0})
    'actor'
    >>> resolve_target_hop("auto", {"cpus": 2, "threads": 1, "n_gpu_layers": 0})
    'compiled'
    >>> resolve_target_hop("auto", {"cpus": 16, "threads": 16, "n_gpu_layers": 33})
    'compiled'
    >>> resolve_target_hop("actor", {"cpus": 16, "threads": 1, "n_gpu_layers": 0})
    'actor'
    >>> resolve_target_hop("auto", {"cpus": 16, "threads": 1, "hidden_transport": {"transport": "object_store"}})
    'compiled'
    """
    if setting != "auto":
        return setting
    spare = (info.get("cpus") or 0) > (info.get("threads") or 0)
    return "compiled" if spare or (info.get("n_gpu_layers") or 0) > 0 else "actor"


def resolve_companion_hop(setting: str, target_info: dict, companion_info: dict) -> str:
    """The companion's hop (ServeConfig.companion_hop): "auto" takes the compiled graph where the node has a
    core beyond the target's and the companion's llama.cpp threads (the companion's graph thread polls through
    every target decode between its calls; the router parks it only when idle), or the target decodes on a
    GPU. A companion without a model makes no round calls: actor.

    >>> resolve_companion_hop("auto", {"threads": 1, "n_gpu_layers": 0}, {"cpus": 2, "threads": 1})
    'actor'
    >>> resolve_companion_hop("auto", {"threads": 1, "n_gpu_layers": 0}, {"cpus": 4, "threads": 2})
    'compiled'
    >>> resolve_companion_hop("auto", {"threads": 16, "n_gpu_layers": 33}, {"cpus": 16, "threads": 16})
    'compiled'
    >>> resolve_companion_hop("auto", {"threads": 1, "n_gpu_layers": 33}, {"cpus": 16, "threads": 0})
    'actor'
    >>> resolve_companion_hop("compiled", {"threads": 2}, {"cpus": 2, "threads": 2})
    'compiled'
    """
    if setting != "auto":
        return setting
    return "compiled" if companion_has_room(target_info, companion_info) else "actor"


def companion_has_room(target_info: dict, companion_info: dict) -> bool:
    """The companion's node has a core beyond the target's and the companion's llama.cpp threads, or the target
    decodes on a GPU: work the companion does while the target decodes (a graph thread's polling, a flush
    replayed behind the round) costs the decode nothing. False for a companion without a model.

    >>> companion_has_room({"threads": 1}, {"cpus": 2, "threads": 1}), companion_has_room({"threads": 1}, {"cpus": 3, "threads": 1})
    (False, True)
    """
    threads = companion_info.get("threads") or 0
    if not threads:
        return False
    spare = (companion_info.get("cpus") or 0) > (target_info.get("threads") or 0) + threads
    return spare or (target_info.get("n_gpu_layers") or 0) > 0


class ExpectedWait:
    """How long to sleep before reading a step's answer: `share` of the shortest of the last `keep` in-actor
    times of steps with as many rows (0 until one was seen). The shortest, because sleeping past the answer
    costs the round; reading early only spins.

    >>> w = ExpectedWait(share=0.8)
    >>> w.before(4)
    0.0
    >>> w.observe(4, 0.012); w.observe(4, 0.010); w.observe(1, 0.020)
    >>> round(w.before(4), 4), round(w.before(1), 4), w.before(2)
    (0.008, 0.016, 0.0)
    """

    def __init__(self, share: float = 0.8, keep: int = 8) -> None:
        self.share = share
        self.keep = keep
        self._recent: dict[int, collections.deque[float]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        d = self._recent.get(rows)
        if d is None:
            d = self._recent[rows] = collections.deque(maxlen=self.keep)
        d.append(seconds)

    def before(self, rows: int) -> float:
        d = self._recent.get(rows)
        return self.share * min(d) if d else 0.0


class CompiledChannel:
    """One compiled graph `InputNode -> actor.channel`; `call` runs one message through it."""

    def __init__(self, actor, timeout_s: float | None = None) -> None:
        from ray.dag import InputNode

        with InputNode() as inp:
            node = actor.channel.bind(inp)
        self._dag = node.experimental_compile()
        self._actor = actor
        self._timeout_s = timeout_s
        self._parked = None  # the park's result, read after the wake
        self.wait = ExpectedWait()
        self.parks = 0
        self.slept_s = 0.0

    def call(self, msg: tuple, rows: int = 0):
        """The actor's answer to `msg` (TargetService.channel); raises what ray.get raises (a dead actor:
        RayChannelError or RayActorError; past timeout_s: RayChannelTimeoutError)."""
        t0 = time.perf_counter()
        return self.answer(self.submit(msg), t0, rows)

    def answer(self, ref, t0: float, rows: int = 0):
        """The answer to a message `submit`ted at `t0` (perf_counter): a nap of the time such a call is
        expected to take, less what has passed since (other work done meanwhile), then the read."""
        import ray

        nap = self.wait.before(rows) - (time.perf_counter() - t0)
        if nap > 0:
            time.sleep(nap)
            self.slept_s += nap
        return ray.get(ref, timeout=self._timeout_s)

    def submit(self, msg: tuple):
        """Run `msg` without waiting: the ref to `ray.get` (results are read in the order they were sent)."""
        self.unpark()
        return self._dag.execute(msg)

    def park(self) -> None:
        """The router is idle: hold the actor's graph thread in a plain wait until the next call."""
        if self._parked is None:
            self._parked = self._dag.execute(("park",))
            self.parks += 1

    def unpark(self) -> None:
        if self._parked is not None:
            import ray

            ref, self._parked = self._parked, None
            self._actor.wake.remote()
            ray.get(ref, timeout=self._timeout_s)

    def close(self) -> None:
        """Tear the graph down (the actor may be dead already: Ray then only closes the channels)."""
        try:
            self.unpark()
        except Exception:  # a dead or hung actor: teardown below is all that is left to do
            pass
        self._dag.teardown()

    def info(self) -> dict:
        return {"parks": self.parks, "slept_ms": round(1000 * self.slept_s, 3)}
