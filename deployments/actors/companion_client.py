"""The router's ONE way to call the companion actor (model-based speculators).

Every companion call goes through `CompanionClient.call`: if the companion is
down, or the call raises or times out (ActorDiedError, a bug in a draft
model, a hang), the caller gets the default (no drafts this round: the
n-gram speculators keep working, the output stays lossless because drafts
only ever propose), the companion is marked down and its supervisor
recreates it in the background with backoff. `/health` reports it
(`degraded` while it is down).

A new companion starts empty: it holds no KV mirror of the sequences that
were running. `epoch` changes with every companion generation, so a
model-based speculator records the epoch it began a sequence in and drafts
nothing for sequences begun on an older one (they finish on n-grams; new
sequences draft again). The router's `draft` speculator in distributed mode
(`CompanionDraftProxy`, deployments/actors/companion.py) makes its one call
per round as `client.call("round", payload, default=None)`.

With `companion_hop: compiled` (`use_hop`) the round calls (`round`, `hidden_round`) go through a Ray
compiled graph to the companion instead (target_channel.CompiledChannel, as the target's rounds do: a
shorter round trip than an actor call's), one graph per companion generation, made on the first round
call to it; a graph that fails counts as any failed call. Every other call stays an actor call.
"""

from __future__ import annotations

from typing import Callable

from specray.deployments.actors.supervisor import UP, ActorSupervisor


#: the per-round calls a compiled companion hop carries (CompanionService.channel); the rest stay actor calls
CHANNEL_METHODS = frozenset({"round", "hidden_round"})


class CompanionClient:
    def __init__(self, sup: ActorSupervisor, timeout_s: float = 10.0) -> None:
        self.sup = sup
        self.timeout_s = timeout_s
        self.calls = 0  # calls attempted while the companion was up
        self.errors = 0  # calls that failed (the companion was then marked down)
        self.skipped = 0  # calls not made because the companion was down
        self.hop = "actor"  # or "compiled": the round calls go through a Ray compiled graph (use_hop)
        self._channel = None  # target_channel.CompiledChannel to the companion of epoch _channel_epoch
        self._channel_epoch: int | None = None
        self.compiles = 0
        self._inflight: list[Pending] = []  # submitted round calls whose answers are not read yet, oldest first
        self.flush_behind = False  # hidden-row flushes go without waiting (engine.hidden.flush_behind, resolved)

    def use_hop(self, hop: str) -> None:
        """'actor' or 'compiled' (ServeConfig.companion_hop, resolved). A compiled graph is made for each
        companion generation on its first round call."""
        if hop not in ("actor", "compiled"):
            raise ValueError(f"companion hop must be 'actor' or 'compiled', got {hop!r}")
        self.hop = hop

    def _channel_to(self, handle, epoch: int):
        if self._channel is None or self._channel_epoch != epoch:
            self.close_channel()
            from .target_channel import CompiledChannel

            self._channel = CompiledChannel(handle, self.timeout_s)
            self._channel_epoch = epoch
            self.compiles += 1
        return self._channel

    def close_channel(self) -> None:
        """Tear the compiled graph down (before its actor is killed or replaced; a dead one: channels only)."""
        ch, self._channel, self._channel_epoch = self._channel, None, None
        if ch is not None:
            try:
                ch.close()
            except Exception:  # the actor is gone either way; the next generation gets a new graph
                pass

    def park(self) -> None:
        """The router is idle: park the companion's graph thread (it would poll a core)."""
        self._settle_all()  # a graph's results are read in order: the park's comes after theirs
        ch = self._channel
        if ch is not None and self.up and self._channel_epoch == self.sup.epoch:
            try:
                ch.park()
            except Exception:  # noticed on the next call, which marks the companion down
                pass

    @property
    def state(self) -> str:
        return self.sup.state

    @property
    def epoch(self) -> int:
        return self.sup.epoch

    @property
    def up(self) -> bool:
        return self.sup.state == UP

    def call(self, method: str, *args, default=None, timeout: float | None = None, **kwargs):
        """companion.method(*args, **kwargs), or `default` if the companion is down or the call fails."""
        import ray

        # the round calls come from the round thread, which alone touches the graph and the calls in flight;
        # others (counters from /v1/stats' thread) are plain actor calls and leave both alone
        rounds = method in CHANNEL_METHODS
        if rounds:
            self._settle_all()
        if (target := self._reach()) is None:
            return default
        handle, epoch = target
        try:
            if rounds and self.hop == "compiled" and not kwargs:
                return self._compiled_call(handle, epoch, method, *args)
            return ray.get(getattr(handle, method).remote(*args, **kwargs),
                           timeout=self.timeout_s if timeout is None else timeout)
        except Exception as e:  # any failure: its state may be broken, so it is replaced
            self._failed(e, epoch, on_round_thread=rounds)
            return default

    def submit(self, method: str, payload: dict) -> "Pending | None":
        """Start a round call (CHANNEL_METHODS) without waiting for it: its answer is read by `Pending.result`,
        at the latest before the next call or park (the companion runs calls in order either way). None if the
        companion is down or the call could not be sent."""
        if method not in CHANNEL_METHODS:
            raise ValueError(f"only round calls go without waiting, not {method!r}")
        if (target := self._reach()) is None:
            return None
        handle, epoch = target
        try:
            if self.hop == "compiled":
                ref = self._channel_to(handle, epoch).submit((method, payload))
            else:
                ref = getattr(handle, method).remote(payload)
        except Exception as e:
            self._failed(e, epoch)
            return None
        p = Pending(ref, epoch, self._read)
        self._inflight.append(p)
        return p

    def _read(self, p: Pending):
        """The answer of a submitted call, which then leaves the calls in flight; None if it failed (the
        companion is then replaced)."""
        import ray

        try:
            return ray.get(p.ref, timeout=self.timeout_s)
        except Exception as e:
            self._failed(e, p.epoch)
            return None
        finally:
            self._inflight.remove(p)

    def _reach(self):
        """(handle, epoch) of the companion for a call about to be made, counted; None (counted as skipped) if it
        is down."""
        sup = self.sup
        if sup.state != UP:
            self.skipped += 1
            return None
        self.calls += 1
        return sup.handle, sup.epoch

    def _settle_all(self) -> None:
        while self._inflight:
            self._inflight[0].result()

    def _failed(self, e: BaseException, epoch: int, on_round_thread: bool = True) -> None:
        """A call failed: its state may be broken, so the companion is replaced. Its graph is torn down here only
        on the round thread; from another one, the round thread's next call to the new generation does it."""
        self.errors += 1
        if on_round_thread and self._channel_epoch == epoch:
            self.close_channel()
        self.sup.mark_down(e, epoch)

    def _compiled_call(self, handle, epoch: int, method: str, payload: dict):
        ch = self._channel_to(handle, epoch)
        n = len(payload.get("requests") or ())  # the wait before reading is learnt per number of drafts asked
        res = ch.call((method, payload), n)
        if isinstance(res, dict) and "inside_s" in res:
            ch.wait.observe(n, res["inside_s"])
        return res

    def counters(self) -> dict:
        """The companion's own counters (empty when down) and this client's."""
        remote = self.call("counters", default={}, timeout=min(self.timeout_s, 10.0)) or {}
        return dict(remote) | {"client_calls": self.calls, "client_errors": self.errors,
                               "client_skipped": self.skipped, "hop": self.hop_stats()}

    def hop_stats(self) -> dict:
        """How the round calls travel: mode, graphs compiled, and the graph's parks and read waits."""
        ch = self._channel
        return {"mode": self.hop, "compiles": self.compiles} | (ch.info() if ch is not None else {})

    def snapshot(self) -> dict:
        return self.sup.snapshot()


class Pending:
    """A round call sent by `CompanionClient.submit`; `result()` waits for its answer once (None: it failed, and
    the companion is being replaced). `read` is the client's: it waits, and handles a failure."""

    def __init__(self, ref, epoch: int, read: Callable[[Pending], object]) -> None:
        self.ref, self.epoch = ref, epoch
        self._read = read
        self.done = False
        self.value = None

    def result(self):
        if not self.done:
            self.done = True
            self.value = self._read(self)
        return self.value
