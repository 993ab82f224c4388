"""bench/server_cpu.py and the decode threads' OS name (native/decode_threads.py): real threads, real /proc."""

from __future__ import annotations

import doctest
import os
import threading
import time

import pytest

from specray.bench import server_cpu
from specray.native import decode_threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")


def _comm(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/comm") as f:
        return f.read().strip()


def _burn(seconds: float) -> None:
    t_end = time.thread_time() + seconds
    while time.thread_time() < t_end:
        pass


def test_doctests():
    failed, attempted = doctest.testmod(server_cpu)
    assert attempted >= 2 and failed == 0


def test_a_named_thread_and_the_threads_it_starts_count_as_decode():
    """The name reaches /proc, threads started afterwards inherit it (as libgomp's workers do), and their CPU
    lands in `decode`, not `other`."""
    ids: dict[str, int] = {}

    def child() -> None:
        ids["child"] = threading.get_native_id()
        _burn(0.2)

    def decoder() -> None:
        ids["decoder"] = threading.get_native_id()
        assert decode_threads.name_os_thread()
        c = threading.Thread(target=child)
        c.start()
        _burn(0.2)
        ids["decoder_comm"] = _comm(ids["decoder"])
        c.join()

    t = threading.Thread(target=decoder)
    t.start()
    while "child" not in ids:
        time.sleep(0.01)
    child_comm = _comm(ids["child"])
    t.join()
    assert ids["decoder_comm"] == child_comm == decode_threads.OS_THREAD_NAME
    while {str(ids["decoder"]), str(ids["child"])} & set(os.listdir("/proc/self/task")):
        time.sleep(0.01)  # joined threads linger in /proc for a moment; their time must not leave mid-window

    # a live named thread's CPU is counted as decode (a thread's time leaves /proc with it)
    burned, done = threading.Event(), threading.Event()

    def live_decoder() -> None:
        ids["live"] = threading.get_native_id()
        decode_threads.name_os_thread()
        _burn(0.3)
        burned.set()
        done.wait()

    pid = [os.getpid()]
    t = threading.Thread(target=live_decoder)
    before, threads0 = server_cpu.cpu_seconds(pid), _thread_seconds()
    t.start()
    burned.wait()
    mid, threads1 = server_cpu.cpu_seconds(pid), _thread_seconds()
    done.set()
    t.join()
    spent = {k: threads1[k] - threads0.get(k, 0.0) for k in threads1}
    busy = sorted(((s, k) for k, s in spent.items()), reverse=True)[:4]
    assert mid["decode"] - before["decode"] >= 0.25, busy
    # "other" grew by what the process's other threads burnt meanwhile (a thread left running by an earlier test
    # may burn some), not by the named thread's burn
    elsewhere = sum(s for (tid, _), s in spent.items() if tid != str(ids["live"]))
    assert mid["other"] - before["other"] < elsewhere + 0.1, busy


def _thread_seconds() -> dict[tuple[str, str], float]:
    """(thread id, name) -> CPU seconds so far, for every thread of this process: what a failure names."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[(tid, _comm(int(tid)))] = server_cpu.stat_seconds(f"/proc/self/task/{tid}/stat")
        except OSError:
            continue
    return out


def test_the_main_thread_keeps_its_name():
    """note() names a decoding thread, never the main one (its name is the process's in `ps`)."""
    main_comm = _comm(threading.main_thread().native_id)
    decode_threads.note()  # called here on the main thread, as an in-process engine's decode would
    assert _comm(threading.main_thread().native_id) == main_comm
    got = {}

    def worker() -> None:
        decode_threads.note()
        got["comm"] = _comm(threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got["comm"] == decode_threads.OS_THREAD_NAME


def test_remote_and_missing_servers_give_no_pids():
    assert server_cpu.is_local("http://127.0.0.1:8000") and server_cpu.is_local("http://localhost:8000/v1")
    assert not server_cpu.is_local("http://10.0.0.5:8000")
    assert server_cpu.server_pids(None) == []
    assert server_cpu.cpu_seconds([2 ** 22 + 12345]) == {"decode": 0.0, "other": 0.0}  # no such process
    assert server_cpu.per_token({"decode": 0, "other": 0}, {"decode": 1, "other": 1}, 0) is None


def test_ray_processes_found_by_name_and_script(tmp_path):
    """A process whose script lives in Ray's package counts as Ray's (the dashboard, the log monitor), one of
    specray's own does not; a real child process, found through /proc, its CPU read from its stat file."""
    import subprocess
    import sys

    script = tmp_path / "site-packages" / "ray" / "_private" / "fake_monitor.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass\n"
                      "time.sleep(30)\n")
    other = tmp_path / "specray_tool.py"
    other.write_text("import time\ntime.sleep(30)\n")
    ray_like = subprocess.Popen([sys.executable, "-u", str(script)])
    plain = subprocess.Popen([sys.executable, str(other)])
    try:
        deadline = time.time() + 20
        while server_cpu.process_seconds([ray_like.pid]) < 0.25 and time.time() < deadline:
            time.sleep(0.05)
        found = server_cpu.ray_pids()
        assert ray_like.pid in found and plain.pid not in found and os.getpid() not in found
        assert ray_like.pid not in server_cpu.ray_pids(exclude=[ray_like.pid])
        assert server_cpu.process_seconds([ray_like.pid]) >= 0.25
        assert server_cpu.process_seconds([2 ** 22 + 1]) == 0.0  # no such process: nothing, no error
    finally:
        ray_like.kill()
        plain.kill()
