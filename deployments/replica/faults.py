"""Faults, on the round thread: a lost target actor, a round that raised, a companion that is down.

Distributed, both actors are supervised (actors/supervisor.py): a dead target
fails the sequences that ran on it with a 503 (queued ones wait), new
submissions get 503 + Retry-After until a new actor is up; a dead or erroring
companion only costs model drafts until it is back (CompanionClient). A
watchdog thread pings both, so a death is noticed even when no round runs.
Co-located there are no actors: only a round that raised (a bug) is handled,
by failing its sequences with a 500 and serving on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from specray.deployments.actors.supervisor import FAILED, UP, is_actor_death, short_error

from .errors import EngineFailure, Unavailable
from .slots import ReliabilityStats, Slots

log = logging.getLogger("specray.router")


class Faults:
    def __init__(self, parts, slots: Slots, rel: ReliabilityStats, mode: str) -> None:
        self.parts = parts  # builder.EngineParts
        self.slots = slots
        self.rel = rel
        self.mode = mode
        self.actors = parts.actors  # None co-located
        self.last_error: str | None = None

    @property
    def supervised(self) -> bool:
        return self.actors is not None

    def target_state(self) -> str:
        return self.actors.target.state if self.actors is not None else UP

    def target_replaced(self) -> bool:
        """A new target actor is up that the proxy does not talk to yet (wakes the idle round thread)."""
        return self.actors is not None and self.parts.remote.epoch != self.actors.target.epoch

    def sync_target(self) -> bool:
        """Line the proxy up with the supervised actor; True if the target can take a round. Sequences
        that ran on a lost actor fail (503); queued ones wait for the new one (or fail if it cannot be
        restarted)."""
        if self.actors is None:
            return True
        sup, remote = self.actors.target, self.parts.remote
        if sup.state == UP and remote.epoch == sup.epoch:
            return True
        running = self.slots.running()
        if running:
            msg = (f"the target model actor failed during this request ({sup.last_error}); "
                   "it is being restarted; retry the request")
            self.rel.failed_target_lost += len(running)
            self.slots.fail(running, Unavailable(msg, code="target_unavailable"))
        if sup.state == UP:  # a fresh actor: nothing of the old one's KV cache exists there
            try:
                remote.reset(sup.handle, sup.epoch)  # compiled hop: a new graph to the new actor
            except Exception as e:
                log.warning("the new target actor's compiled graph failed: %s", short_error(e))
                sup.mark_down(e, sup.epoch)
                return False
            self.parts.scheduler.forget_prompt_cache(clear_kv=False)
            return True
        queue = self.parts.scheduler.queue
        if sup.state == FAILED and queue:
            self.slots.fail(list(queue), Unavailable(
                f"the target model actor could not be restarted ({sup.last_error})", code="target_unavailable"))
        return False

    def round_failed(self, e: Exception) -> None:
        """A round raised. A lost actor is marked down (the supervisor restarts it; its sequences fail with
        a 503 in sync_target); anything else is a bug: the running sequences get a 500, queued ones stay,
        unless nothing was running: then the round failed admitting them, as every round would, and they get
        the 500 instead of waiting for their clients' timeouts."""
        if self.actors is not None and is_actor_death(e):
            self.actors.target.mark_down(e, self.parts.remote.epoch)
            self.sync_target()
            return
        self.rel.round_failures += 1
        self.last_error = short_error(e)
        seqs = self.slots.running() or list(self.parts.scheduler.queue)
        log.exception("round failed; failing %d requests", len(seqs))
        self.slots.fail(seqs, EngineFailure(f"internal error: {self.last_error}"))
        # what a failed round left in the KV cells is unknown: no later prompt may reuse them
        self.parts.scheduler.forget_prompt_cache()

    def flush_releases(self) -> None:
        """Idle, distributed: send the releases buffered for the target actor (frees its KV cells now)."""
        try:
            self.parts.remote.flush()
        except Exception as e:
            log.warning("flushing releases to the target actor failed: %s", short_error(e))
            if is_actor_death(e):
                self.actors.target.mark_down(e, self.parts.remote.epoch)

    def park_target(self) -> None:
        """Idle, distributed with compiled hops: park the actors' graph threads (target_channel.py)."""
        if self.actors is None:
            return
        self.actors.companion.park()
        if self.actors.target.state != UP or self.parts.remote.epoch != self.actors.target.epoch:
            return
        try:
            self.parts.remote.park()
        except Exception as e:
            log.warning("parking the target actor's compiled graph failed: %s", short_error(e))

    def start_watchdog(self, interval_s: float, ping_timeout_s: float, stopping) -> threading.Thread | None:
        """Ping the actors every interval_s until stopping() (distributed only)."""
        if self.actors is None or interval_s <= 0:
            return None

        def watch() -> None:
            while not stopping():
                time.sleep(interval_s)
                if stopping():
                    return
                self.actors.target.check(ping_timeout_s)
                self.actors.companion.sup.check(ping_timeout_s)

        t = threading.Thread(target=watch, name="specray-watchdog", daemon=True)
        t.start()
        return t

    def health(self, round_thread_alive: bool) -> dict:
        """What /health reports: status ok | degraded (companion down) | recovering (target down) | failed."""
        d: dict[str, Any] = {"mode": self.mode, "round_thread": round_thread_alive}
        status = "ok" if round_thread_alive else "failed"
        if self.actors is not None:
            target, companion = self.actors.target, self.actors.companion
            d["target"] = target.snapshot()
            d["companion"] = companion.snapshot()
            if target.state == FAILED:
                status = "failed"
            elif target.state != UP and status == "ok":
                status = "recovering"
            elif companion.state != UP and status == "ok":
                status = "degraded"
        d["status"] = status
        return d
