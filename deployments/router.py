"""The router core of an engine replica: one round thread, per-request asyncio streams.

`RouterCore` owns the round `Scheduler` (not thread-safe). One background
thread is its only user: it takes submissions and cancellations from an inbox
at the top of every round, runs `scheduler.step()` while there is work, and
feeds each request's asyncio queue through `loop.call_soon_threadsafe` (one
wake-up per event loop per round). The asyncio side never blocks on a round;
a submission waits at most one round to be admitted or refused, and a
cancellation (client gone) frees the slot and its KV cells at the top of the
next round.

Target: co-located, a `TargetRunner` in this process; distributed, a
`RemoteTarget` over the target actor (one hop per round), with a companion
actor alongside for model-based speculators. Both actors are supervised
(`ActorSupervisor`): a dead target fails the sequences that ran on it with a
503 (queued ones wait), new submissions get 503 + Retry-After until a new
actor is up; a dead or erroring companion only costs model drafts until it
is back (`CompanionClient`). A watchdog thread pings both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from specray.engine.chain import Chain
from specray.engine.cost import DecodeCostModel
from specray.engine.request import GenerationRequest, Sequence, SeqState
from specray.engine.scheduler import Event, QueueFullError, Scheduler

from .actor_supervisor import FAILED, UP, ActorSupervisor, is_actor_death, short_error
from .metrics import timing_of
from .serve_config import ServeConfig

log = logging.getLogger("specray.router")

#: Ray namespace of the named target / companion actors (names in /v1/stats; tests kill them by name)
ACTOR_NAMESPACE = "specray"
#: stop strings: OpenAI allows 4; the cap keeps the per-token stop matching cheap
MAX_STOPS, MAX_STOP_CHARS = 16, 512


class RequestError(Exception):
    """A request the router refuses; carries the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass
class ServeRequest(GenerationRequest):
    """A GenerationRequest plus what the router did to it on the way in."""

    truncated_prompt_tokens: int = 0  # prompt tokens dropped (from the left) to fit the context
    t_arrival: float = field(default_factory=time.perf_counter)  # reached the replica (TTFT starts here)


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
    round_posted: int = 0  # scheduler round count when posted (cancel latency in rounds)


@dataclass
class ReliabilityStats:
    cancelled: int = 0  # sequences cancelled because their caller went away
    cancel_rounds_max: int = 0  # rounds between a cancel being posted and applied (at most 1 by design)
    rejected_queue_full: int = 0
    rejected_target_down: int = 0
    failed_target_lost: int = 0  # sequences failed because the target actor died under them
    round_failures: int = 0  # rounds that raised for another reason (bug): their sequences got a 500
    truncated_prompts: int = 0


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
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    truncated = getattr(seq.req, "truncated_prompt_tokens", 0)
    if truncated:
        usage["truncated_prompt_tokens"] = truncated
    return {
        "type": "end",
        "finish_reason": seq.finish_reason,
        "usage": usage,
        "speculative": seq.spec_summary() | {"rounds": seq.rounds},
        "timing": timing_of(seq),
    }


def error_item(status: int, message: str, code: str | None = None) -> dict:
    return {"type": "error", "status": status, "message": message, "param": None, "code": code}


def process_rss() -> int | None:
    """Resident set size of this process in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _replica_tag() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests of the core)
        return uuid.uuid4().hex[:8]


class RouterCore:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        ecfg = cfg.engine
        self.mode = cfg.mode
        self.companion = None  # CompanionClient (distributed)
        self.draft_model = None  # co-located: the `draft` speculator's model, in this process
        self.hidden_heads = None  # co-located: the mtp / eagle3 heads, in this process
        self.target_sup: ActorSupervisor | None = None
        self.runner = None
        self.remote = None
        self.placement: dict | None = None
        self.rel = ReliabilityStats()
        self.observer = None  # metrics.EngineMetrics (set by the replica): told on the round thread
        self._cv = threading.Condition()
        cost = DecodeCostModel()  # replaced by a measured one when ecfg.calibrate
        if cfg.mode == "colocated":
            from specray.engine.target import TargetRunner

            from .local_engine import open_draft, open_hidden, open_target

            self.model, self.ctx = open_target(ecfg)
            self.draft_model = open_draft(ecfg, self.model, self.ctx)
            self.runner = TargetRunner(self.ctx, record_margins=ecfg.record_margins)
            self.hidden_heads = open_hidden(ecfg, self.model, self.ctx, self.runner)
            target = self.runner
            n_ctx_total = self.ctx.n_ctx
            n_ctx_seq = self.ctx.n_ctx_seq
            kv_unified = self.ctx.kv_unified
            if ecfg.calibrate:
                cost = DecodeCostModel.calibrated(self.runner.calibrate_cost())
        else:
            import ray

            from specray.native.model import Model

            from .target_actor import RemoteTarget

            self.target_sup, self.companion = self._start_actors()
            # the router only tokenizes and detokenizes: vocabulary without weights
            self.model = Model(ecfg.model, chat_template=ecfg.chat_template, vocab_only=True)
            self.target_info = self.target_sup.info
            self.companion_info = self.companion.sup.info
            rc = ray.get_runtime_context()
            self.placement = {
                "strategy": "STRICT_PACK" if self._strategy is not None else None,
                "replica": {"placement_group_id": rc.get_placement_group_id(), "node_id": rc.get_node_id()},
                "target": {k: self.target_info[k] for k in ("placement_group_id", "node_id", "pid", "env")},
                "companion": {k: self.companion_info[k] for k in ("placement_group_id", "node_id", "pid")},
            }
            self.remote = RemoteTarget(self.target_sup.handle, epoch=self.target_sup.epoch,
                                       timeout_s=cfg.target_step_timeout_s)
            target = self.remote
            n_ctx_total = self.target_info["n_ctx"]
            n_ctx_seq = self.target_info["n_ctx_seq"]
            kv_unified = self.target_info["kv_unified"]
            if ecfg.calibrate:
                cost = DecodeCostModel.calibrated(ray.get(self.target_sup.handle.calibrate_cost.remote()))
        # as LocalEngine: a sequence may use n_ctx_seq cells; with a unified KV cache all slots share n_ctx
        self.n_ctx = n_ctx_total
        self.n_ctx_seq = n_ctx_seq
        if self.companion is not None:  # model speculators run in the companion actor, one call per round
            from .companion_actor import companion_speculator_factory

            factory = companion_speculator_factory(self.companion, ecfg, ack_sink=self.remote.ack_hidden)
        else:
            from .local_engine import local_speculator_factory

            factory = local_speculator_factory(self.draft_model, self.hidden_heads)
        self.chain = Chain(ecfg.chain, factory)
        self.scheduler = Scheduler(ecfg, target, self.model, self.chain, n_ctx_seq, cost,
                                   shared_cells=n_ctx_total if kv_unified else None)
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.Lock()  # guards every scheduler call (held by the round thread)
        self._inbox: list[_Op] = []
        self._stopping = False
        self.last_error: str | None = None
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="specray-rounds", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if self.target_sup is not None and cfg.watchdog_interval_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="specray-watchdog", daemon=True)
            self._watchdog.start()

    # ---- actors (distributed) ------------------------------------------------------------------
    def _start_actors(self):
        import ray

        from specray.cluster.placement import COMPANION_BUNDLE, TARGET_BUNDLE, actor_strategy

        from .companion_actor import CompanionActor
        from .companion_client import CompanionClient
        from .target_actor import TargetActor

        cfg, ecfg = self.cfg, self.cfg.engine
        tag = f"{cfg.app_name}:{_replica_tag()}"
        self._strategy = actor_strategy(TARGET_BUNDLE)

        def actor_options(role: str, gen: int, cpus: float, gpus: float, bundle: int, **extra: Any) -> dict:
            opts: dict[str, Any] = {"num_cpus": cpus, "name": f"{tag}:{role}:{gen}", "namespace": ACTOR_NAMESPACE,
                                    **extra}
            if cfg.worker_env:
                opts["runtime_env"] = {"env_vars": dict(cfg.worker_env)}
            if gpus:
                opts["num_gpus"] = gpus
            strategy = actor_strategy(bundle)
            if strategy is not None:
                opts["scheduling_strategy"] = strategy
            return opts

        def ready(handle, name: str) -> dict:
            return ray.get(handle.info.remote(), timeout=cfg.actor_start_timeout_s) | {"actor_name": name}

        def make_target(gen: int):
            opts = actor_options("target", gen, cfg.target_cpus, cfg.target_gpus, TARGET_BUNDLE, max_concurrency=2)
            return TargetActor.options(**opts).remote(ecfg.model_dump()), opts["name"]

        def make_companion(gen: int):
            opts = actor_options("companion", gen, cfg.companion_cpus, cfg.companion_gpus, COMPANION_BUNDLE)
            return CompanionActor.options(**opts).remote(ecfg.model_dump()), opts["name"]

        common = dict(max_attempts=cfg.actor_restart_attempts, on_change=lambda _: self._wake())
        target = ActorSupervisor("target", make_target, ready, **common)
        companion = ActorSupervisor("companion", make_companion, ready, **common)
        target.start()
        companion.start()
        return target, CompanionClient(companion, timeout_s=cfg.companion_call_timeout_s)

    @property
    def target_actor(self):
        return self.target_sup.handle if self.target_sup is not None else None

    def _watch(self) -> None:
        """Ping the actors now and then: a death is noticed (and repaired) even when no round runs."""
        while not self._stopping:
            time.sleep(self.cfg.watchdog_interval_s)
            if self._stopping:
                return
            self.target_sup.check(self.cfg.actor_ping_timeout_s)
            self.companion.sup.check(self.cfg.actor_ping_timeout_s)

    def target_state(self) -> str:
        return self.target_sup.state if self.target_sup is not None else UP

    # ---- request side (asyncio) ------------------------------------------------------------
    def prompt_tokens(self, request: dict) -> np.ndarray:
        if request.get("messages") is not None:
            msgs = request["messages"]
            if not msgs:
                raise RequestError("messages must not be empty", param="messages")
            return self.model.chat_tokens(msgs)
        if request.get("prompt_tokens") is not None:
            try:
                toks = np.asarray(request["prompt_tokens"], dtype=np.int64)
            except (OverflowError, ValueError, TypeError):
                raise RequestError(f"prompt token ids must be in [0, {self.model.n_vocab})", param="prompt") from None
            if toks.ndim != 1:
                raise RequestError("prompt token ids must be a flat list of integers", param="prompt")
            if toks.size == 0:
                raise RequestError("prompt is empty", param="prompt")
            if toks.min() < 0 or toks.max() >= self.model.n_vocab:
                raise RequestError(f"prompt token ids must be in [0, {self.model.n_vocab})", param="prompt")
            return toks.astype(np.int32)
        prompt = request.get("prompt")
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def make_request(self, request: dict) -> ServeRequest:
        """The engine request for a replica request dict; RequestError (400) for anything wrong with it."""
        try:
            return self._make_request(request)
        except RequestError:
            raise
        except UnicodeError:
            raise RequestError("text must be valid Unicode (lone surrogate escapes are not)") from None
        except (ValueError, TypeError, OverflowError) as e:
            raise RequestError(str(e)) from None

    def _make_request(self, request: dict) -> ServeRequest:
        from specray.engine.sampling import SamplingParams

        kw: dict[str, Any] = {}
        if request.get("request_id"):
            kw["request_id"] = request["request_id"]
        chain = request.get("chain")
        stop = list(request.get("stop") or [])
        if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise RequestError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters",
                               param="stop")
        max_tokens = int(request.get("max_tokens", 256))
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        n_max = request.get("n_max")
        prompt, truncated = self._fit_prompt(self.prompt_tokens(request), max_tokens, chain, n_max)
        return ServeRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=SamplingParams.model_validate(request.get("sampling") or {}),
            stop=stop,
            chain=None if chain is None else tuple(chain),
            n_max=n_max,
            ignore_eos=bool(request.get("ignore_eos", False)),
            truncated_prompt_tokens=truncated,
            **kw,
        )

    def _fit_prompt(self, prompt: np.ndarray, max_tokens: int, chain, n_max) -> tuple[np.ndarray, int]:
        """Context check before the round thread sees the request (so the answer names the limit);
        with prompt_overflow=truncate, the oldest prompt tokens are dropped to make room."""
        c = self.cfg.engine.chain
        speculates = bool(c.speculators) if chain is None else bool(chain)
        draft_room = min(c.n_max, c.n_max if n_max is None else n_max) if speculates else 0
        room = self.n_ctx_seq - max_tokens - draft_room - 1  # prompt tokens that fit (see Scheduler.validate)
        if max_tokens >= self.n_ctx_seq or room < 1:
            raise RequestError(
                f"max_tokens ({max_tokens}) does not fit the context of {self.n_ctx_seq} tokens per sequence "
                f"(with room for {draft_room} draft tokens)", param="max_tokens")
        if len(prompt) <= room:
            return prompt, 0
        if self.cfg.prompt_overflow == "truncate":
            return prompt[len(prompt) - room:].copy(), len(prompt) - room
        raise RequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.n_ctx_seq} "
            f"tokens per sequence; shorten the prompt or lower max_tokens", param="prompt",
            code="context_length_exceeded")

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
        self._post(_Op("cancel", seq=seq, round_posted=self.scheduler.stats.rounds))

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

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # ---- round thread ----------------------------------------------------------------------
    def _run(self) -> None:
        can_step = False
        while True:
            with self._cv:
                while not self._inbox and not can_step and not self._stopping:
                    if self.remote is not None and self.remote.pending() and self.target_state() == UP:
                        break  # idle: flush buffered releases to the actor first
                    # a lost target is noticed by the supervisor (which wakes us); the timeout is a backstop
                    self._cv.wait(timeout=None if self.target_sup is None else 1.0)
                    if self.target_sup is not None and self.remote.epoch != self.target_sup.epoch:
                        break
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            out: dict[asyncio.AbstractEventLoop, list] = {}
            with self.lock:
                ready = self._sync_target(out)
                for op in inbox:
                    self._apply(op, out, ready)
                events: list[Event] = []
                if ready and self.scheduler.has_work():
                    try:
                        events = self.scheduler.step()
                    except Exception as e:
                        if self.target_sup is not None and is_actor_death(e):
                            self.target_sup.mark_down(e, self.remote.epoch)
                            self._sync_target(out)
                        else:  # a real bug: fail what runs, keep serving
                            self._fail_all(e, out)
                elif ready and self.remote is not None and self.remote.pending():
                    try:
                        self.remote.flush()
                    except Exception as e:
                        log.warning("flushing releases to the target actor failed: %s", short_error(e))
                        if is_actor_death(e):
                            self.target_sup.mark_down(e, self.remote.epoch)
                for ev in events:
                    self._event(ev, out)
                can_step = ready and self.scheduler.has_work()
                self._observe_round(idle=not can_step)
            for loop, items in out.items():
                _call_in_loop(loop, _deliver, items)

    def _sync_target(self, out: dict) -> bool:
        """Distributed: line the proxy up with the supervised actor. Sequences that ran on a lost
        actor fail (503); queued ones wait for the new one (or fail if it cannot be restarted)."""
        sup = self.target_sup
        if sup is None:
            return True
        if sup.state == UP and self.remote.epoch == sup.epoch:
            return True
        running = self._running()
        if running:
            msg = (f"the target model actor failed during this request ({sup.last_error}); "
                   "it is being restarted; retry the request")
            self.rel.failed_target_lost += len(running)
            self._fail_seqs(running, error_item(503, msg, "target_unavailable"), out)
        if sup.state == UP:  # a fresh actor: nothing of the old one's KV cache exists there
            self.remote.reset(sup.handle, sup.epoch)
            return True
        if sup.state == FAILED and self.scheduler.queue:
            self._fail_seqs(list(self.scheduler.queue), error_item(
                503, f"the target model actor could not be restarted ({sup.last_error})", "target_unavailable"), out)
        return False

    def _apply(self, op: _Op, out: dict, target_ready: bool = True) -> None:
        if op.kind == "submit":
            loop = op.stream.loop
            if not target_ready:
                self.rel.rejected_target_down += 1
                _call_in_loop(loop, _resolve, op.future, None, RequestError(
                    "the target model is restarting; retry shortly", 503, code="target_unavailable"))
                return
            try:
                seq = self.scheduler.submit(op.req)
            except QueueFullError as e:
                self.rel.rejected_queue_full += 1
                _call_in_loop(loop, _resolve, op.future, None, RequestError(str(e), 429, code="queue_full"))
                return
            except ValueError as e:
                _call_in_loop(loop, _resolve, op.future, None, RequestError(str(e), 400))
                return
            except Exception as e:
                log.exception("submit failed")
                _call_in_loop(loop, _resolve, op.future, None, RequestError(f"internal error: {e}", 500))
                return
            if op.stream.abandoned:
                self.scheduler.cancel(seq)
                return
            op.stream.seq = seq
            self.streams[seq.id] = op.stream
            _call_in_loop(loop, _resolve, op.future, seq)
        elif op.kind == "cancel":
            self.streams.pop(op.seq.id, None)
            if not op.seq.finished:
                self.rel.cancelled += 1
                self.rel.cancel_rounds_max = max(self.rel.cancel_rounds_max,
                                                 self.scheduler.stats.rounds - op.round_posted)
                try:
                    self.scheduler.cancel(op.seq)
                except Exception:
                    log.exception("cancel failed")
                if op.seq.finished:  # cancelled while queued: no round will report it
                    self._observe_finished(op.seq)
        elif op.kind == "call":
            try:
                op.result.append((True, op.fn()))
            except Exception as e:
                op.result.append((False, e))
            op.done.set()

    def _observe_round(self, idle: bool) -> None:
        if self.observer is None:
            return
        s = self.scheduler
        try:
            self.observer.after_round(self.chain.stats(), len(s.active), len(s.queue), idle)
        except Exception:  # metrics never stop the rounds
            log.exception("metrics update failed")

    def _observe_finished(self, seq: Sequence) -> None:
        if self.observer is None or getattr(seq, "observed", False):
            return
        seq.observed = True
        try:
            self.observer.request_finished(seq)
        except Exception:
            log.exception("metrics update failed")

    def _event(self, ev: Event, out: dict) -> None:
        if ev.finished:
            self._observe_finished(ev.seq)
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

    def _fail_seqs(self, seqs: list[Sequence], item: dict, out: dict) -> None:
        for seq in seqs:
            st = self.streams.pop(seq.id, None)
            if st is not None:
                out.setdefault(st.loop, []).append((st.queue, item))
            if not seq.finished:
                try:
                    self.scheduler.cancel(seq)
                except Exception:
                    log.exception("cancel of a failed sequence failed")

    def _running(self) -> list[Sequence]:
        """Sequences past the queue whose callers still wait: the active ones, and any a failed
        round finished without delivering its end."""
        seqs = list(self.scheduler.active.values())
        seqs += [st.seq for st in self.streams.values()
                 if st.seq is not None and st.seq.state != SeqState.QUEUED and st.seq not in seqs]
        return seqs

    def _fail_all(self, e: Exception, out: dict) -> None:
        """A round raised for another reason than a lost actor (a bug): its sequences get a 500,
        queued ones stay queued."""
        self.rel.round_failures += 1
        self.last_error = short_error(e)
        seqs = self._running()
        log.exception("round failed; failing %d requests", len(seqs))
        self._fail_seqs(seqs, error_item(500, f"internal error: {self.last_error}"), out)

    # ---- introspection ------------------------------------------------------------------------
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> dict:
        """What /health reports: status ok | degraded (companion down) | recovering (target down) | failed."""
        d: dict[str, Any] = {"mode": self.mode, "round_thread": self.alive()}
        status = "ok" if self.alive() else "failed"
        if self.target_sup is not None:
            d["target"] = self.target_sup.snapshot()
            d["companion"] = self.companion.snapshot()
            t = self.target_sup.state
            if t == FAILED:
                status = "failed"
            elif t != UP and status == "ok":
                status = "recovering"
            elif self.companion.state != UP and status == "ok":
                status = "degraded"
        d["status"] = status
        return d

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
                "free_slots": len(s.free_slots),
                "reserved_cells": s.reserved,
                "streams": len(self.streams),
                "scheduler": asdict(s.stats),
                "chain": self.cfg.engine.chain.label,
                "disabled_speculators": sorted(s.disabled_speculators),
                "speculators": {k: asdict(v) for k, v in self.chain.stats().items()},
                "cost_table": self.scheduler.cost.table(),
                "attention_ns_per_token_cell": self.scheduler.cost.attn_seconds * 1e9,
                "round_failures": self.rel.round_failures,
                "reliability": asdict(self.rel),
                "last_error": self.last_error,
                "process": {"pid": os.getpid(), "rss_bytes": process_rss()},
            }
            if self.runner is not None:
                r = self.runner
                d["target"] = {
                    "where": "in-process",
                    "rounds": r.rounds,
                    "multi_seq_decodes": r.multi_seq_decodes,
                    "max_seqs_in_decode": r.max_seqs_in_decode,
                    "step_decodes": r.step_decodes,
                    "step_decode_seqs": r.step_decode_seqs,
                    # KV cells per slot (0 = empty): a finished or cancelled sequence leaves none
                    "kv_cells": [self.ctx.seq_pos_max(i) + 1 for i in range(self.cfg.engine.slots)],
                }
            if self.remote is not None:
                d["hop"] = self.remote.hop.to_dict()
                d["placement"] = self.placement
                d["pending_releases"] = len(self.remote._releases)
            return d

        d = self.call(snap)
        if self.target_sup is not None:
            import ray

            d["target"] = {"where": "actor"} | self.target_sup.snapshot()
            if self.target_sup.state == UP:
                try:
                    d["target"] |= ray.get(self.target_sup.handle.counters.remote(), timeout=10)
                except Exception as e:
                    d["target"]["counters_error"] = short_error(e)
            d["companion"] = self.companion.snapshot() | self.companion.counters()
        return d

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=5)
        if self.target_sup is not None:
            self.target_sup.close()
            self.companion.sup.close()


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
