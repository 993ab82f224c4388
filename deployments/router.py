"""The router core of an engine replica: one round thread, per-request asyncio streams.

`RouterCore` owns the round `Scheduler` (not thread-safe). One background
thread is its only user: it takes submissions and cancellations from an inbox
at the top of every round, runs `scheduler.step()` while there is work, and
feeds each request's asyncio queue through `loop.call_soon_threadsafe` (one
wake-up per event loop per round). The asyncio side never blocks on a round;
a submission waits at most one round to be admitted or refused.

Target: co-located, a `TargetRunner` in this process; distributed, a
`RemoteTarget` over the target actor (one hop per round), with a companion
actor alongside for model-based speculators (none yet: no hop is paid).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from specray.engine.chain import Chain
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest, Sequence
from specray.engine.scheduler import Event, QueueFullError, Scheduler
from specray.engine.speculators.registry import make_speculator

from .serve_config import ServeConfig

log = logging.getLogger("specray.router")


class RequestError(Exception):
    """A request the router refuses; carries the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence | None = None
    abandoned: bool = False  # the caller went away before the submission was answered


@dataclass
class _Op:
    kind: str  # submit | cancel | call
    req: GenerationRequest | None = None
    stream: _Stream | None = None
    future: asyncio.Future | None = None
    seq: Sequence | None = None
    fn: Any = None
    done: threading.Event | None = None
    result: list = field(default_factory=list)


def _resolve(fut: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def end_info(seq: Sequence) -> dict:
    n_prompt = len(seq.req.prompt_tokens)
    n_gen = len(seq.generated)
    return {
        "type": "end",
        "finish_reason": seq.finish_reason,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        "speculative": seq.spec_summary() | {"rounds": seq.rounds},
    }


class RouterCore:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        ecfg = cfg.engine
        self.mode = cfg.mode
        self.target_actor = None
        self.companion = None
        self.runner = None
        self.remote = None
        self.placement: dict | None = None
        table: dict[int, float] | None = None
        if cfg.mode == "colocated":
            from specray.engine.target import TargetRunner

            from .local_engine import open_target

            self.model, self.ctx = open_target(ecfg)
            self.runner = TargetRunner(self.ctx, record_margins=ecfg.record_margins)
            target = self.runner
            n_ctx_total = self.ctx.n_ctx
            n_ctx_seq = self.ctx.n_ctx_seq
            kv_unified = self.ctx.kv_unified
            if ecfg.calibrate:
                table = self.runner.measure_decode_costs()
        else:
            import ray

            from specray.cluster.placement import COMPANION_BUNDLE, TARGET_BUNDLE, actor_strategy
            from specray.native.model import Model

            from .companion_actor import CompanionActor
            from .target_actor import RemoteTarget, TargetActor

            def actor_options(cpus: float, gpus: float, bundle: int, **extra: Any) -> dict[str, Any]:
                opts: dict[str, Any] = {"num_cpus": cpus, **extra}
                if cfg.worker_env:
                    opts["runtime_env"] = {"env_vars": dict(cfg.worker_env)}
                if gpus:
                    opts["num_gpus"] = gpus
                strategy = actor_strategy(bundle)
                if strategy is not None:
                    opts["scheduling_strategy"] = strategy
                return opts

            opts = actor_options(cfg.target_cpus, cfg.target_gpus, TARGET_BUNDLE, max_concurrency=2)
            strategy = opts.get("scheduling_strategy")
            self.target_actor = TargetActor.options(**opts).remote(ecfg.model_dump())
            copts = actor_options(cfg.companion_cpus, cfg.companion_gpus, COMPANION_BUNDLE)
            self.companion = CompanionActor.options(**copts).remote(ecfg.model_dump())
            # the router only tokenizes and detokenizes: vocabulary without weights
            self.model = Model(ecfg.model, chat_template=ecfg.chat_template, vocab_only=True)
            self.target_info = ray.get(self.target_actor.info.remote())
            self.companion_info = ray.get(self.companion.info.remote())
            rc = ray.get_runtime_context()
            self.placement = {
                "strategy": "STRICT_PACK" if strategy is not None else None,
                "replica": {"placement_group_id": rc.get_placement_group_id(), "node_id": rc.get_node_id()},
                "target": {k: self.target_info[k] for k in ("placement_group_id", "node_id", "pid", "env")},
                "companion": {k: self.companion_info[k] for k in ("placement_group_id", "node_id", "pid")},
            }
            self.remote = RemoteTarget(self.target_actor)
            target = self.remote
            n_ctx_total = self.target_info["n_ctx"]
            n_ctx_seq = self.target_info["n_ctx_seq"]
            kv_unified = self.target_info["kv_unified"]
            if ecfg.calibrate:
                table = {int(k): v for k, v in ray.get(self.target_actor.measure_decode_costs.remote()).items()}
        # as LocalEngine: a sequence may use n_ctx_seq cells; with a unified KV cache all slots share n_ctx
        self.n_ctx = n_ctx_total
        self.n_ctx_seq = n_ctx_seq
        self.chain = Chain(ecfg.chain, make_speculator)
        self.scheduler = Scheduler(ecfg, target, self.model, self.chain, n_ctx_seq, DecodeCostModel(table),
                                   shared_cells=n_ctx_total if kv_unified else None)
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()  # guards every scheduler call (held by the round thread)
        self._cv = threading.Condition()
        self._inbox: list[_Op] = []
        self._stopping = False
        self.failures = 0
        self.last_error: str | None = None
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="specray-rounds", daemon=True)
        self._thread.start()

    # ---- request side (asyncio) ------------------------------------------------------------
    def prompt_tokens(self, request: dict) -> np.ndarray:
        if request.get("messages") is not None:
            msgs = request["messages"]
            if not msgs:
                raise RequestError("messages must not be empty", param="messages")
            return self.model.chat_tokens(msgs)
        if request.get("prompt_tokens") is not None:
            toks = np.asarray(request["prompt_tokens"], dtype=np.int64)
            if toks.size == 0:
                raise RequestError("prompt is empty", param="prompt")
            if toks.min() < 0 or toks.max() >= self.model.n_vocab:
                raise RequestError(f"prompt token ids must be in [0, {self.model.n_vocab})", param="prompt")
            return toks.astype(np.int32)
        prompt = request.get("prompt")
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def make_request(self, request: dict) -> GenerationRequest:
        from specray.engine.sampling import SamplingParams

        kw: dict[str, Any] = {}
        if request.get("request_id"):
            kw["request_id"] = request["request_id"]
        chain = request.get("chain")
        return GenerationRequest(
            prompt_tokens=self.prompt_tokens(request),
            max_tokens=int(request.get("max_tokens", 256)),
            sampling=SamplingParams.model_validate(request.get("sampling") or {}),
            stop=list(request.get("stop") or []),
            chain=None if chain is None else tuple(chain),
            n_max=request.get("n_max"),
            ignore_eos=bool(request.get("ignore_eos", False)),
            **kw,
        )

    async def submit(self, req: GenerationRequest) -> tuple[Sequence, asyncio.Queue]:
        """Queue a request; returns once the round thread has accepted it (or raises RequestError)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        fut = loop.create_future()
        self._post(_Op("submit", req=req, stream=stream, future=fut))
        try:
            seq = await fut
        except asyncio.CancelledError:
            stream.abandoned = True
            if stream.seq is not None:
                self.cancel(stream.seq)
            raise
        return seq, stream.queue

    def cancel(self, seq: Sequence) -> None:
        self._post(_Op("cancel", seq=seq))

    def call(self, fn, timeout: float | None = 30.0):
        """Run fn() on the round thread between rounds (thread-safe scheduler access)."""
        op = _Op("call", fn=fn, done=threading.Event())
        self._post(op)
        if not op.done.wait(timeout):
            raise TimeoutError("the round thread did not answer")
        ok, val = op.result[0]
        if not ok:
            raise val
        return val

    def _post(self, op: _Op) -> None:
        with self._cv:
            self._inbox.append(op)
            self._cv.notify()

    # ---- round thread ----------------------------------------------------------------------
    def _run(self) -> None:
        has_work = False
        while True:
            with self._cv:
                while not self._inbox and not has_work and not self._stopping:
                    if self.remote is not None and (self.remote._releases or self.remote._starts):
                        break  # idle: flush buffered releases to the actor first
                    self._cv.wait()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            out: dict[asyncio.AbstractEventLoop, list] = {}
            with self.lock:
                for op in inbox:
                    self._apply(op, out)
                events: list[Event] = []
                if self.scheduler.has_work():
                    try:
                        events = self.scheduler.step()
                    except Exception as e:  # a real bug or a dead actor: fail what runs, keep serving
                        self._fail_all(e, out)
                elif self.remote is not None and (self.remote._releases or self.remote._starts):
                    try:
                        self.remote.flush()
                    except Exception:
                        log.exception("flushing releases to the target actor failed")
                has_work = self.scheduler.has_work()
                for ev in events:
                    self._event(ev, out)
            for loop, items in out.items():
                _call_in_loop(loop, _deliver, items)

    def _apply(self, op: _Op, out: dict) -> None:
        if op.kind == "submit":
            try:
                seq = self.scheduler.submit(op.req)
            except QueueFullError as e:
                _call_in_loop(op.stream.loop, _resolve, op.future, None, RequestError(str(e), 429, code="queue_full"))
                return
            except ValueError as e:
                _call_in_loop(op.stream.loop, _resolve, op.future, None, RequestError(str(e), 400))
                return
            except Exception as e:
                log.exception("submit failed")
                _call_in_loop(op.stream.loop, _resolve, op.future, None, RequestError(f"internal error: {e}", 500))
                return
            if op.stream.abandoned:
                self.scheduler.cancel(seq)
                return
            op.stream.seq = seq
            self.streams[seq.id] = op.stream
            _call_in_loop(op.stream.loop, _resolve, op.future, seq)
        elif op.kind == "cancel":
            self.streams.pop(op.seq.id, None)
            if not op.seq.finished:
                try:
                    self.scheduler.cancel(op.seq)
                except Exception:
                    log.exception("cancel failed")
        elif op.kind == "call":
            try:
                op.result.append((True, op.fn()))
            except Exception as e:
                op.result.append((False, e))
            op.done.set()

    def _event(self, ev: Event, out: dict) -> None:
        st = self.streams.get(ev.seq.id)
        if st is None:
            return
        if st.abandoned:
            del self.streams[ev.seq.id]
            if not ev.seq.finished:
                self.scheduler.cancel(ev.seq)
            return
        items = out.setdefault(st.loop, [])
        if ev.text:
            items.append((st.queue, {"type": "delta", "text": ev.text}))
        if ev.finished:
            del self.streams[ev.seq.id]
            items.append((st.queue, end_info(ev.seq)))

    def _fail_all(self, e: Exception, out: dict) -> None:
        self.failures += 1
        self.last_error = "".join(traceback.format_exception_only(type(e), e)).strip()
        log.exception("round failed; failing %d requests", len(self.streams))
        for sid, st in list(self.streams.items()):
            out.setdefault(st.loop, []).append(
                (st.queue, {"type": "error", "status": 500, "message": f"internal error: {self.last_error}"})
            )
            if st.seq is not None and not st.seq.finished:
                try:
                    self.scheduler.cancel(st.seq)
                except Exception:
                    log.exception("cancel after a failed round failed")
        self.streams.clear()

    # ---- introspection ------------------------------------------------------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict:
        """Counters for /v1/stats (thread-safe: read on the round thread between rounds)."""

        def snap() -> dict:
            s = self.scheduler
            d = {
                "mode": self.mode,
                "slots": self.cfg.engine.slots,
                "n_ctx": self.n_ctx,
                "n_ctx_seq": self.n_ctx_seq,
                "active": len(s.active),
                "queued": len(s.queue),
                "reserved_cells": s.reserved,
                "scheduler": asdict(s.stats),
                "chain": self.cfg.engine.chain.label,
                "disabled_speculators": sorted(s.disabled_speculators),
                "speculators": {k: asdict(v) for k, v in self.chain.stats().items()},
                "cost_table": self.scheduler.cost.table(),
                "round_failures": self.failures,
                "last_error": self.last_error,
            }
            if self.runner is not None:
                r = self.runner
                d["target"] = {
                    "where": "in-process",
                    "rounds": r.rounds,
                    "multi_seq_decodes": r.multi_seq_decodes,
                    "max_seqs_in_decode": r.max_seqs_in_decode,
                }
            if self.remote is not None:
                d["hop"] = self.remote.hop.to_dict()
                d["placement"] = self.placement
            return d

        d = self.call(snap)
        if self.target_actor is not None:
            import ray

            d["target"] = {"where": "actor"} | ray.get(self.target_actor.counters.remote(), timeout=30)
            d["companion"] = ray.get(self.companion.counters.remote(), timeout=30)
        return d

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=5)
        if self.target_actor is not None:
            import ray

            for a in (self.target_actor, self.companion):
                try:
                    ray.kill(a)
                except Exception:
                    pass


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


async def next_chunk(queue: asyncio.Queue) -> tuple[str, dict | None]:
    """Wait for the next item, then take whatever else is queued already.

    Returns (text, terminal): the text of every delta taken, and the end/error
    item if one was reached (a stream has nothing after it).
    """
    item = await queue.get()
    texts: list[str] = []
    while True:
        if item["type"] != "delta":
            return "".join(texts), item
        texts.append(item["text"])
        if queue.empty():
            return "".join(texts), None
        item = queue.get_nowait()
