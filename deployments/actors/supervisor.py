"""One Ray actor kept alive by its owner: state, generation, restart with backoff.

The router owns its target and companion actors (they live in the replica's
placement group). When one dies (killed, OOM, node trouble) or stops
answering, `mark_down` starts ONE background thread that kills what is left
of it and creates a new one with the same options, with exponential backoff,
up to `max_attempts` in a row (then the state is `failed` and the replica's
health check fails, so Serve replaces the whole replica).

Ray's own `max_restarts` is not used: `ray.kill` (the usual way to take an
actor down) does not restart, and a restarted actor would come back with an
empty KV cache that the router must know about anyway. `epoch` changes with
every new actor, so callers can tell "the actor I started this sequence on"
from the current one.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger("specray.supervisor")

UP, DOWN, FAILED = "up", "down", "failed"


def short_error(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def is_actor_death(e: BaseException) -> bool:
    """Errors that mean the actor itself is gone or unreachable (not a bug in the call)."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError

    # RayChannelError (its timeout included): a compiled target hop (target_channel.py) whose actor died or hung
    return isinstance(e, (RayActorError, GetTimeoutError, RayChannelError))


class ActorSupervisor:
    def __init__(
        self,
        role: str,
        create: Callable[[int], tuple[Any, str]],
        ready: Callable[[Any, str], dict],
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_attempts: int = 8,
        on_change: Callable[[ActorSupervisor], None] | None = None,
    ) -> None:
        """create(n) -> (actor handle, actor name) for the n-th actor created (names must not repeat: a
        killed actor's name may linger); ready(handle, name) -> info dict, raises if the actor is not
        usable (the name is what tests and operators look the actor up by)."""
        self.role = role
        self._create = create
        self._ready = ready
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_attempts = max_attempts
        self.on_change = on_change
        self._lock = threading.Lock()
        self.handle: Any = None
        self.info: dict = {}
        self.state = DOWN
        self.epoch = 0  # generation of the current actor (1 = the first one)
        self._created = 0  # actors created so far (failed attempts included): unique names
        self.restarts = 0
        self.failures = 0  # times the actor was found dead / unresponsive
        self.last_error: str | None = None
        self.down_since: float | None = None
        self.last_restart_seconds: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> dict:
        """Create the first actor, synchronously (the replica's constructor fails if this fails)."""
        self._created += 1
        handle, name = self._create(self._created)
        info = self._ready(handle, name)
        with self._lock:
            self.handle, self.info, self.epoch, self.state = handle, info, 1, UP
        return info

    def mark_down(self, error: BaseException | str, epoch: int | None = None) -> None:
        """The actor of `epoch` (default: the current one) failed; restart it in the background.

        A stale report (about an actor already replaced) is ignored."""
        msg = error if isinstance(error, str) else short_error(error)
        with self._lock:
            if self._closed or (epoch is not None and epoch != self.epoch) or self.state != UP:
                return
            self.state = DOWN
            self.failures += 1
            self.last_error = msg
            self.down_since = time.time()
            old = self.handle
            self._thread = threading.Thread(target=self._restart, args=(old,), name=f"specray-restart-{self.role}",
                                            daemon=True)
            self._thread.start()
        log.warning("%s actor down (%s); restarting", self.role, msg)
        self._notify()

    def _restart(self, old: Any) -> None:
        import ray

        if old is not None:
            try:  # a hung actor still holds its resources (and the placement group bundle)
                ray.kill(old, no_restart=True)
            except Exception:
                pass
        delay = self.backoff_s
        t0 = time.perf_counter()
        for attempt in range(1, self.max_attempts + 1):
            if self._closed:
                return
            handle = None
            try:
                self._created += 1
                handle, name = self._create(self._created)
                info = self._ready(handle, name)
            except Exception as e:
                self.last_error = f"restart attempt {attempt}: {short_error(e)}"
                log.warning("%s actor restart attempt %d failed: %s", self.role, attempt, self.last_error)
                if handle is not None:
                    try:
                        ray.kill(handle, no_restart=True)
                    except Exception:
                        pass
                time.sleep(delay)
                delay = min(self.max_backoff_s, delay * 2)
                continue
            with self._lock:
                if self._closed:
                    ray.kill(handle, no_restart=True)
                    return
                self.handle, self.info = handle, info
                self.epoch += 1
                self.restarts += 1
                self.state = UP
                self.down_since = None
                self.last_restart_seconds = time.perf_counter() - t0
            log.warning("%s actor restarted (generation %d) in %.1fs", self.role, self.epoch,
                        self.last_restart_seconds)
            self._notify()
            return
        with self._lock:
            self.state = FAILED
        log.error("%s actor could not be restarted after %d attempts", self.role, self.max_attempts)
        self._notify()

    def _notify(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception:
                log.exception("on_change callback failed")

    def check(self, timeout: float) -> bool:
        """Ping the actor (if up); a dead or silent actor is marked down. True if it answered."""
        import ray

        with self._lock:
            if self.state != UP:
                return False
            handle, epoch = self.handle, self.epoch
        try:
            ray.get(handle.ping.remote(), timeout=timeout)
            return True
        except Exception as e:
            self.mark_down(e, epoch)
            return False

    def wait_up(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.state == UP:
                return True
            if self.state == FAILED:
                return False
            time.sleep(0.05)
        return self.state == UP

    def close(self) -> None:
        import ray

        with self._lock:
            self._closed = True
            handle = self.handle
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass

    def snapshot(self) -> dict:
        return {
            "state": self.state,
            "generation": self.epoch,
            "restarts": self.restarts,
            "failures": self.failures,
            "last_error": self.last_error,
            "down_for_s": round(time.time() - self.down_since, 3) if self.down_since else None,
            "last_restart_s": self.last_restart_seconds,
            "pid": self.info.get("pid"),
            "name": self.info.get("actor_name"),
        }
