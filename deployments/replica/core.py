"""The router core of an engine replica: one round thread, per-request asyncio streams.

`RouterCore` owns the engine that deployments/builder.py assembles (its round
`Scheduler` is not thread-safe). One background thread is its only user; each
turn of its loop (`_run`, below) is one round:

1. take the inbox: submissions, cancellations and calls posted since the last
   round (slots.py applies them; faults.py first lines the target proxy up
   with a restarted actor);
2. `scheduler.step()`: drafts, ONE target decode, verification, bookkeeping
   (engine/scheduler.py), or, idle and distributed, flush buffered releases;
3. hand the round's events to their streams' sinks (slots.py, sinks.py);
   the loop path's items reach each event loop with one wake-up a round.

The asyncio side never blocks on a round: a submission waits at most one
round to be admitted or refused, and a cancellation (client gone) frees the
slot and its KV cells at the top of the next round. Admission checks run
before that, on the caller's side (admission.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from specray.deployments.actors.launch import start_actors
from specray.deployments.builder import build_engine
from specray.deployments.config import ServeConfig
from specray.engine.config import ChainConfig
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.scheduler import Event
from specray.native import decode_threads

from . import stats
from .admission import Admission, ServeRequest
from .faults import Faults
from .request import EngineRequest
from .sinks import LoopSink, Outbox, next_chunk  # noqa: F401  (next_chunk re-exported)
from .slots import ReliabilityStats, Slots
from .streams import Op, Stream


def _replica_tag() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests of the core)
        return uuid.uuid4().hex[:8]


class RouterCore:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.mode = cfg.mode
        self._cv = threading.Condition()
        self.lock = threading.Lock()  # guards every scheduler call (held by the round thread)
        self._inbox: list[Op] = []
        self.outbox = Outbox()  # the loop path's items of the round being made (round thread)
        self._stopping = False
        actors = None
        if cfg.mode == "distributed":
            actors = start_actors(cfg, f"{cfg.app_name}:{_replica_tag()}", on_change=lambda _: self._wake())
        # the engine is built on the round thread, the one that decodes every round: llama.cpp's OpenMP threads
        # are pooled per calling thread, and a second live thread that once decoded (calibration here) would
        # halve the decode speed (native/decode_threads.py)
        built: list[BaseException | None] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(actors, built, ready), name="specray-rounds",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if built[0] is not None:
            if actors is not None:
                actors.close()
            raise built[0]
        self.started_at = time.time()
        self._watchdog = self.faults.start_watchdog(cfg.watchdog_interval_s, cfg.actor_ping_timeout_s,
                                                    lambda: self._stopping)

    def _build(self, actors) -> None:
        cfg = self.cfg
        self.parts = build_engine(cfg.engine, actors=actors, step_timeout_s=cfg.target_step_timeout_s, served=True,
                                  target_hop=cfg.target_hop, companion_hop=cfg.companion_hop)
        self.placement = actors.placement() if actors is not None else None
        self.rel = ReliabilityStats()
        self.slots = Slots(self.parts.scheduler, self.rel)
        if self.parts.scheduler.overlap:
            # overlapped rounds: each event goes to its stream as it is made, while the next round decodes, and
            # the batch to the event loops at once (else they would wait for the round's end)
            self.parts.scheduler.on_event = self.slots.event
            self.parts.scheduler.on_delivered = self.outbox.flush
            self.slots.cancels_later = []
        self.faults = Faults(self.parts, self.slots, self.rel, cfg.mode)
        self.admission = Admission(self.parts.model, self.parts.n_ctx_seq, lambda: self.scheduler.config.chain,
                                   truncate=cfg.prompt_overflow == "truncate", slots=cfg.engine.slots,
                                   context_shift=cfg.engine.context_shift,
                                   can_shift=self.parts.scheduler.memory.can_shift)

    # ---- the engine's parts (tests, stats, the replica) ------------------------------------------
    model = property(lambda self: self.parts.model)
    scheduler = property(lambda self: self.parts.scheduler)
    chain = property(lambda self: self.parts.chain)
    ctx = property(lambda self: self.parts.ctx)  # co-located only
    runner = property(lambda self: self.parts.runner)  # co-located only
    remote = property(lambda self: self.parts.remote)  # distributed only
    draft_model = property(lambda self: self.parts.draft_model)
    hidden_heads = property(lambda self: self.parts.hidden_heads)
    n_ctx = property(lambda self: self.parts.n_ctx)
    n_ctx_seq = property(lambda self: self.parts.n_ctx_seq)
    target_sup = property(lambda self: self.parts.actors.target if self.parts.actors else None)
    companion = property(lambda self: self.parts.actors.companion if self.parts.actors else None)
    target_actor = property(lambda self: self.target_sup.handle if self.target_sup is not None else None)
    last_error = property(lambda self: self.faults.last_error)

    @property
    def observer(self):
        return self.slots.observer

    @observer.setter
    def observer(self, obs) -> None:  # metrics.EngineMetrics (set by the replica): told on the round thread
        self.slots.observer = obs

    # ---- request side (asyncio) ------------------------------------------------------------
    def make_request(self, request: EngineRequest) -> ServeRequest:
        return self.admission.make_request(request)

    def prompt_tokens(self, request: EngineRequest):
        return self.admission.prompt_tokens(request)

    async def submit(self, req: GenerationRequest, sink: LoopSink | None = None) -> tuple[Sequence, LoopSink]:
        """Queue a request; returns once the round thread has accepted it, with the sink its items go to
        (`sink`, made on this loop, or a new LoopSink), or raises the ServeError that refused it (errors.py)."""
        loop = asyncio.get_running_loop()
        if sink is None:
            sink = LoopSink()
        sink.open(self.outbox)
        stream = Stream(loop, sink)
        fut = loop.create_future()
        self._post(Op("submit", req=req, stream=stream, future=fut))
        try:
            seq = await fut
        except asyncio.CancelledError:
            stream.abandoned = True
            if stream.seq is not None:
                self.cancel(stream.seq)
            raise
        return seq, sink

    def cancel(self, seq: Sequence) -> None:
        self._post(Op("cancel", seq=seq, round_posted=self.scheduler.rounds_run))

    def call(self, fn, timeout: float | None = 30.0):
        """Run fn() on the round thread between rounds (thread-safe scheduler access)."""
        op = Op("call", fn=fn, done=threading.Event())
        self._post(op)
        if not op.done.wait(timeout):
            raise TimeoutError("the round thread did not answer")
        ok, val = op.result[0]
        if not ok:
            raise val
        return val

    def set_chain(self, new: ChainConfig) -> dict:
        """Swap the running chain for `new` between rounds; running sequences go on with it
        (Scheduler.reconfigure_chain). Raises ValueError, changing nothing, if `new` cannot be built."""
        result = self.call(lambda: self.scheduler.reconfigure_chain(new))
        self.cfg = self.cfg.model_copy(update={"engine": self.cfg.engine.model_copy(update={"chain": new})})
        return result

    def _post(self, op: Op) -> None:
        with self._cv:
            self._inbox.append(op)
            self._cv.notify()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # ---- round thread ----------------------------------------------------------------------
    def _run(self, actors, built: list, ready: threading.Event) -> None:
        if actors is None:  # co-located: this thread decodes; named before llama.cpp runs here, so that
            decode_threads.name_os_thread()  # libgomp's workers, which it starts, inherit the name
        try:
            self._build(actors)
        except BaseException as e:
            built.append(e)
            return
        else:
            built.append(None)
        finally:
            ready.set()
        self._loop()

    def _loop(self) -> None:
        can_step = False
        while True:
            inbox = self._wait(can_step)
            if inbox is None:
                return
            with self.lock:
                ready = self.faults.sync_target()
                for op in inbox:
                    self.slots.apply(op, ready)
                events: list[Event] = []
                if ready and self.scheduler.has_work():
                    try:
                        events = self.scheduler.step()
                    except Exception as e:
                        self.faults.round_failed(e)
                elif ready and self.remote is not None and self.remote.pending():
                    self.faults.flush_releases()
                if self.scheduler.on_event is None:
                    for ev in events:
                        self.slots.event(ev)
                self.slots.apply_cancels()
                can_step = ready and self.scheduler.has_work()
                stats.observe_round(self, idle=not can_step)
            self.outbox.flush()

    def _wait(self, can_step: bool) -> list[Op] | None:
        """Block until there is something to do; the inbox taken (None: stop)."""
        with self._cv:
            while not self._inbox and not can_step and not self._stopping:
                if self.remote is not None and self.remote.pending() and self.faults.target_state() == "up":
                    break  # idle: flush buffered releases to the actor first
                self.faults.park_target()
                # a lost target is noticed by the supervisor (which wakes us); the timeout is a backstop
                self._cv.wait(timeout=None if not self.faults.supervised else 1.0)
                if self.faults.target_replaced():
                    break
            if self._stopping:
                return None
            inbox, self._inbox = self._inbox, []
            return inbox

    # ---- introspection ------------------------------------------------------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def target_state(self) -> str:
        return self.faults.target_state()

    def health(self) -> dict:
        """What /health reports: status ok | degraded (companion down) | recovering (target down) | failed."""
        # the target's memory kind (attention, recurrent, hybrid) and how it takes rejected drafts back
        return self.faults.health(self.alive()) | {"target_memory": self.scheduler.memory.to_dict()}

    def stats(self) -> dict:
        """Counters for /v1/stats (thread-safe: read on the round thread between rounds)."""
        d = self.call(lambda: stats.round_snapshot(self))
        if self.parts.actors is not None:
            d |= stats.actor_counters(self.parts.actors)
        return d

    def close(self) -> None:
        if getattr(self, "_closed", False):  # the fused deployment closes it, then the replica's __del__ again
            return
        self._closed = True
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=5)
        if self.parts.actors is not None:
            self.parts.remote.close()  # a compiled graph goes before its actor
            self.parts.actors.close()
