"""An arm's engine deployment scales 1 -> 2 replicas under sustained load and back to 1 when idle, on local
Ray, without a failed request (short delays and small CPU shares; bounded waits)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import ENGINE, deploy

pytestmark = [pytest.mark.serve, pytest.mark.model]

APP = "autoscale"
DEPLOYMENT = "EngineReplica-fast"
SLOTS = 2
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 4,
               "look_back_period_s": 2, "metrics_interval_s": 0.5}  # target_ongoing_requests: SLOTS (default)


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)


def wait_for(pred, timeout: float, what: str) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return time.time() - t0
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


class Load:
    """`n` clients sending requests back to back (each waits for its answer) until stopped."""

    def __init__(self, base: str, n: int, max_tokens: int = 24) -> None:
        self.base, self.n, self.max_tokens = base, n, max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(n)]

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as c:
            i = 0
            while not self._stop.is_set():
                body = {"messages": [{"role": "user", "content": f"Count from {k} to {k + 20}, one per line."}],
                        "max_tokens": self.max_tokens, "temperature": 0, "user": f"user-{k}-{i}"}
                try:
                    r = c.post("/v1/chat/completions", json=body)
                    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code}: {r.text[:200]}")
                except Exception as e:  # a dropped connection is a failure too
                    self.failures.append(f"{type(e).__name__}: {e}")
                i += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def autoscaled(ray_serve):
    from ray import serve

    engine = ENGINE | {"slots": SLOTS, "threads": 1, "n_ctx": 1024}
    base = deploy(ray_serve, APP, {"mode": "colocated", "engine": engine, "replica_cpus": 0.1,
                                   "arms": [{"name": "fast", "chain": "ngram_mod,suffix",
                                             "autoscaling": AUTOSCALING}]})
    try:
        yield base
    finally:
        serve.delete(APP)


def test_arm_scales_up_under_load_and_down_when_idle_without_failed_requests(autoscaled):
    assert running_replicas() == 1
    with Load(autoscaled, n=4 * SLOTS) as load:  # 8 ongoing requests against a target of 2 per replica
        up = wait_for(lambda: running_replicas() == 2, 120, "a second replica under load")
        # the new replica takes traffic: both report rounds while the load goes on
        def both_busy():
            eng = httpx.get(f"{autoscaled}/v1/stats", timeout=60).json()["arms"]["fast"]["engine"]
            return eng["replicas"] == 2 and eng["scheduler"].get("rounds", 0) > 0 and all(
                p is not None for p in eng["pids"])
        wait_for(both_busy, 60, "/v1/stats to see both replicas")
        served_at_peak = load.ok
    print(f"\nscaled up after {up:.1f}s of load; {served_at_peak} requests served by then")
    assert not load.failures, load.failures[:3]

    with Load(autoscaled, n=1) as trickle:  # one client: well under the target, so the arm scales down
        down = wait_for(lambda: running_replicas() == 1, 120, "scaling back to one replica")
        time.sleep(1.0)  # requests keep flowing through the shutdown of the second replica
    print(f"scaled down {down:.1f}s after the load stopped; {trickle.ok} requests during the scale-down")
    assert not trickle.failures, trickle.failures[:3]
    assert trickle.ok > 0 and load.ok > 0
    st = httpx.get(f"{autoscaled}/v1/stats", timeout=60).json()["arms"]["fast"]
    assert st["requests"] == load.ok + trickle.ok and st["errors"] == 0  # nothing was lost on the way
