"""A driver killed hard leaves no Ray process behind (``init_ray``'s watchdog, ``ray_reaper``).

Without the watchdog the raylet's dashboard and runtime-env agents outlive a SIGKILLed driver
by ~60 s (measured with Ray 2.60: they block reporting the raylet's death to the dead GCS).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.distributed import ray_reaper

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc (Linux)")

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import ray
from core.distributed import init_ray

init_ray(num_cpus=1)

@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return 1

probe = Probe.remote()
ray.get(probe.ping.remote())
print(ray._private.worker.global_worker.node.get_session_dir_path(), flush=True)
import time
time.sleep(600)
"""


def _wait_until_empty(session_dir: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := ray_reaper.session_processes(session_dir)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def _titles(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            continue
    return out


def test_a_sigkilled_driver_takes_its_whole_ray_session_down():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)  # a session of its own, never the test session's
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    session_dir = None
    hang_guard = threading.Timer(180, driver.kill)  # a driver stuck starting Ray fails the test, not CI
    hang_guard.start()
    try:
        session_dir = driver.stdout.readline().strip()
        assert session_dir and os.path.isdir(session_dir), f"driver did not start Ray (rc {driver.poll()})"
        before = _titles(ray_reaper.session_processes(session_dir))
        # The processes that used to linger are there, and the actor: the check below is not vacuous.
        assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::Probe"} <= set(before), before

        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        left = _wait_until_empty(session_dir, timeout_s=10)
        assert not left, f"still running 10 s after the driver's SIGKILL: {_titles(left)}"
    finally:
        hang_guard.cancel()
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if session_dir:
            ray_reaper.reap(session_dir)  # a failed run must not leave its processes to the next test


def _spawn(argv0: str, log: Path) -> subprocess.Popen:
    """A ``sleep`` whose title is ``argv0`` and which holds ``log`` open (as its stdout)."""
    with open(log, "w") as out:
        return subprocess.Popen([argv0, "60"], executable="/bin/sleep", stdout=out, stderr=subprocess.DEVNULL)


def test_reap_kills_only_ray_processes_of_that_session(tmp_path):
    session, other = tmp_path / "session_a" / "logs", tmp_path / "session_b" / "logs"
    session.mkdir(parents=True)
    other.mkdir(parents=True)
    ours = _spawn("ray::IDLE", session / "worker.out")
    not_ray = _spawn("/bin/sleep", session / "driver.log")  # e.g. a second driver attached to it
    other_session = _spawn("ray::IDLE", other / "worker.out")
    try:
        assert ray_reaper.session_processes(str(session.parent)) == [ours.pid]
        assert ray_reaper.reap(str(session.parent)) == [ours.pid]
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert not_ray.poll() is None and other_session.poll() is None
    finally:
        for proc in (ours, not_ray, other_session):
            proc.kill()
            proc.wait()
