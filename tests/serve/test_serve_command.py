"""`specray serve` as a user runs it, as a process: on a machine with no Ray running it starts its own; where
`ray start --head` left a cluster running it joins that one (it used to stop with Ray's "num_cpus and num_gpus
must not be provided"); both say which on their first line and answer the official openai client.

Each test gets its own TMPDIR, so the clusters here are invisible to the suite's shared Ray session (Ray keeps
its files, and the address `ray start` records, under the temp dir) and are stopped by killing their own
process groups, never with `ray stop` (which would stop every Ray on the machine).
"""

from __future__ import annotations

import os
import signal
import threading
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.model]

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env():
    # short: Ray's socket paths live under the temp dir and must stay under 108 characters
    tmp = tempfile.mkdtemp(prefix="srt", dir="/tmp")
    e = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": tmp}
    yield e


def _stop(proc: subprocess.Popen, timeout: float = 90) -> None:
    """Ctrl-C to the command itself (what a user does), then whatever of its process group is left. (CI once
    saw the server outlive 60 s and then 150 s of waiting: it had inherited SIGINT ignored, see _serve, not a
    slow shutdown; alone it stops in a few seconds.)"""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serve(env: dict, *flags: str) -> tuple[subprocess.Popen, int, list[str]]:
    """Start `specray serve` and wait until it serves; returns (process, port, its stdout lines so far).
    It starts with SIGINT ignored, as a command put in the background by a script (`cmd &`, no job control:
    CI runners) inherits it: Ctrl-C (`_stop`) must still stop it."""
    port = _free_port()
    proc = subprocess.Popen([str(BIN / "specray"), "serve", "--port", str(port), "--spec", "none", "--slots", "1",
                             "--n-ctx", "512", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_ignore_sigint)
    lines: list[str] = []
    deadline = time.time() + 240
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "specray: serving" in line:
            # keep reading: a pipe nobody drains fills up (64 KiB of Ray's logs) and the server then blocks on
            # a write, so it could not stop on Ctrl-C (seen in CI as a kill after 60 s)
            threading.Thread(target=lambda: [lines.append(ln.rstrip()) for ln in proc.stdout], daemon=True).start()
            return proc, port, lines
    _stop(proc)
    pytest.fail("specray serve did not come up:\n" + "\n".join(lines[-40:]))


def _ask(port: int) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120)
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Name a color."}])
    return r.choices[0].message.content


def _environ_of(comm: str | None, tmpdir: str, script: str | None = None) -> dict[str, str]:
    """The environment of the process named `comm` (/proc/PID/comm), or else of one whose command line runs
    `script`, that runs with TMPDIR=tmpdir (this test's Ray, not the suite's shared one)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if comm is not None:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != comm:
                        continue
            else:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not any(arg.endswith(script.encode()) for arg in f.read().split(b"\0")):
                        continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv]
        except OSError:
            continue
        e = dict(pairs)
        if e.get("TMPDIR") == tmpdir:
            return e
    raise AssertionError(f"no {comm} of this test's Ray")


def test_serve_starts_its_own_ray_where_none_runs(env):
    """A new local Ray, quiet (cluster/ray_env.py): its processes get the settings, but one the user set."""
    from specray.cluster.ray_env import QUIET_RAY_ENV

    env = env | {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"}
    proc, port, lines = _serve(env)
    try:
        ray_line = next(ln for ln in lines if ln.startswith("specray: ") and "Ray" in ln)
        assert "started a local Ray" in ray_line and "no running Ray cluster found" in ray_line, lines
        assert f"quiet: {len(QUIET_RAY_ENV) - 1} settings slow Ray's periodic loops" in ray_line, ray_line
        controller = _environ_of("ray::ServeContr", env["TMPDIR"])  # comm: 15 characters
        raylet = _environ_of("raylet", env["TMPDIR"])
        assert controller["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"  # the user's value
        # the log monitor is started beside the raylet, from the driver; the dashboard agent, which the raylet
        # starts from its own environment, is not looked up: in one CI run no process of this test's Ray had its
        # name (`ray::DashboardA`) when the server answered
        log_monitor = _environ_of(None, env["TMPDIR"], script="log_monitor.py")
        for k, v in QUIET_RAY_ENV.items():
            if k != "RAY_SERVE_CONTROL_LOOP_INTERVAL_S":
                assert controller[k] == raylet[k] == log_monitor[k] == v, k
        assert _ask(port)
    finally:
        _stop(proc)
    assert proc.returncode == 0, "\n".join(lines[-30:])


def test_serve_joins_the_cluster_ray_start_left_running(env):
    gcs_port = _free_port()
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={gcs_port}", "--num-cpus=3",
                             "--include-dashboard=false", "--block"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        recorded = Path(env["TMPDIR"]) / "ray" / "ray_current_cluster"
        deadline = time.time() + 120
        while not recorded.exists() and time.time() < deadline and head.poll() is None:
            time.sleep(0.5)
        assert recorded.exists(), head.stdout.read() if head.poll() is not None else "ray start did not record"
        proc, port, lines = _serve(env)
        try:
            ray_line = next(ln for ln in lines if ln.startswith("specray: ") and "Ray" in ln)
            assert "joined the Ray cluster" in ray_line and f":{gcs_port}" in ray_line, lines
            assert "3 CPUs" in ray_line  # the cluster's own resources, not ones specray asked for
            assert _ask(port)
        finally:
            _stop(proc)
        assert proc.returncode == 0, "\n".join(lines[-30:])
        assert head.poll() is None  # leaving took only specray's app down, not the user's cluster
    finally:
        _stop(head)


def _listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:port (Linux: the socket's inode in /proc/net/tcp, then whose fd it is)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    return None


def test_serve_direct_ingress_the_engine_replica_listens_on_the_port(env):
    """--direct-ingress (fused layout): the engine replica itself answers on --port (no proxy process in the
    way), streams, and Serve's proxy, moved to the port the serving line names, still answers too."""
    proc, port, lines = _serve(env, "--direct-ingress")
    try:
        line = next(ln for ln in lines if "specray: serving" in ln)
        assert f"direct ingress: the replica listens on {port}" in line, line
        proxy_port = int(line.split("Serve's proxy on ")[1].split(",")[0])
        stats = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="x").get("/v1/stats", cast_to=object)
        assert stats["ingress"]["layout"] == "fused"
        assert _listener_pid(port) == stats["ingress"]["pids"][0] == stats["process"]["pid"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120)
        chunks = list(client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0, stream=True,
                                                     messages=[{"role": "user", "content": "Name a color."}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert _ask(proxy_port)
    finally:
        _stop(proc)
    assert proc.returncode == 0, "\n".join(lines[-30:])
