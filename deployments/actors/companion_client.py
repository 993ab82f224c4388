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
"""

from __future__ import annotations

from specray.deployments.actors.supervisor import UP, ActorSupervisor


class CompanionClient:
    def __init__(self, sup: ActorSupervisor, timeout_s: float = 10.0) -> None:
        self.sup = sup
        self.timeout_s = timeout_s
        self.calls = 0  # calls attempted while the companion was up
        self.errors = 0  # calls that failed (the companion was then marked down)
        self.skipped = 0  # calls not made because the companion was down

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

        sup = self.sup
        if sup.state != UP:
            self.skipped += 1
            return default
        handle, epoch = sup.handle, sup.epoch
        self.calls += 1
        try:
            return ray.get(getattr(handle, method).remote(*args, **kwargs),
                           timeout=self.timeout_s if timeout is None else timeout)
        except Exception as e:  # any failure: its state may be broken, so it is replaced
            self.errors += 1
            sup.mark_down(e, epoch)
            return default

    def counters(self) -> dict:
        """The companion's own counters (empty when down) and this client's."""
        remote = self.call("counters", default={}, timeout=min(self.timeout_s, 10.0)) or {}
        return dict(remote) | {"client_calls": self.calls, "client_errors": self.errors,
                               "client_skipped": self.skipped}

    def snapshot(self) -> dict:
        return self.sup.snapshot()
