"""A quieter local Ray: slower periodic loops in Ray's own processes, so they take less CPU from the decode.

On a small node llama.cpp's decode threads use every core, and each of them
waits for the others at every barrier of the graph: whatever else runs on a
core stalls the whole decode, not just one thread. An idle `specray serve`
spends CPU outside the engine every second: the Serve controller's 10 Hz
control loop (and the GCS answering it), the replica's and proxy's
cached-metrics export at 10 Hz, the raylet's 10 Hz resource reports and GC
checks, so a decode beside an idle server runs slower than with Ray's
processes frozen (docs/serving.md, quiet local Ray). These settings cut that
idle CPU; what is left is mostly
fixed in Ray (each worker's main thread checks for signals every 10 ms, the
dashboard agent, the log monitor).

Each setting only slows a loop whose period is far below what it serves:
- the Serve control loop at 0.5 s instead of 0.1 s: deployment changes,
  health checks (10 s) and autoscaling decisions react up to 0.4 s later;
- Serve's replicas and routers hand their cached request metrics to Ray's
  metrics agent every 1 s instead of 0.1 s (the agent pushes every 10 s
  anyway; /v1/stats is live);
- the raylet's resource reports to the GCS every 1 s instead of 0.1 s, its
  check for a needed Python GC and for idle workers to kill every 1 s: one
  node, nothing else schedules on it;
- the log monitor lists the session's log folder for new files every 2 s
  instead of on each 0.1 s pass (it still reads the files it has open at
  10 Hz, so a known worker's lines reach the driver as fast; a new worker's
  first lines up to 2 s later, none lost: a new file is read from its start);
- the dashboard agent's node report (psutil over every worker process, for
  Ray's metrics; specray starts no dashboard) every 10 s instead of 5 s.

Applied only where `specray serve` starts its own local Ray (it sets them in
its environment before ray.init, and Ray's processes inherit it); a variable
already set keeps its value; `--no-quiet-ray` leaves Ray's defaults. A
cluster started with `ray start` gets them by exporting the same variables
before it (docs/serving.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

#: variable -> value; Ray's defaults (2.60) in the comments
QUIET_RAY_ENV: dict[str, str] = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # 0.1
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # 100
    "RAY_raylet_report_resources_period_milliseconds": "1000",  # 100
    "RAY_raylet_check_gc_period_milliseconds": "1000",  # 100
    "RAY_kill_idle_workers_interval_ms": "1000",  # 200
    # the log monitor lists the session's log folder for new files on every 0.1 s pass while it watches fewer
    # files than this, else every LOG_NAME_UPDATE_INTERVAL_S: at 1, the latter from its first file on
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "1",  # 1000
    "LOG_NAME_UPDATE_INTERVAL_S": "2",  # 0.5
    # the dashboard agent's node report (psutil over every worker process) for Ray's metrics; no dashboard runs
    "REPORTER_UPDATE_INTERVAL_MS": "10000",  # 5000
}


def quiet_ray_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of QUIET_RAY_ENV that `environ` does not set already (the user's own value wins).

    >>> env = quiet_ray_env({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"})
    >>> "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" in env, env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]
    (False, '1000')
    """
    return {k: v for k, v in QUIET_RAY_ENV.items() if k not in environ}


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in os.environ inside the block, the old values back after it. Around ray.init, which starts
    Ray's processes with this environment: later ones (workers) are started by the raylet, from its own.

    >>> with environment({"SPECRAY_DOCTEST_X": "1"}):
    ...     os.environ["SPECRAY_DOCTEST_X"]
    '1'
    >>> "SPECRAY_DOCTEST_X" in os.environ
    False
    """
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
