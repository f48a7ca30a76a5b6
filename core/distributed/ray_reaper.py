"""Kill what is left of a local Ray session once its driver is gone (standard library only).

Why: when the driver that started a local Ray (``init_ray``) is killed hard (SIGKILL, OOM
killer), Ray's kernel fate-sharing takes the GCS, the raylet and the workers down with it,
but the raylet's two agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are
reparented to init and linger: they notice the raylet's death within seconds, then block
reporting it to the GCS that died too (a 60 s RPC timeout) before they exit.

:func:`init_ray` starts this file as a watchdog process (``python ray_reaper.py --watch
DRIVER_PID RAYLET_PID SESSION_DIR``, in a session of its own so that the signal which kills
the driver's process group does not reach it).  It polls every 0.5 s; once the driver or the
raylet is gone, it SIGKILLs every Ray process (``ray::*`` or a binary/script of the ``ray``
package) that holds a file of that session directory open, and exits.  Processes of other
Ray sessions (other test runs, a ``ray start`` cluster) hold other directories' files and are
never touched; nor is any non-Ray process (a second driver attached to the session).

By hand, for a session whose watchdog was killed too::

    python -m core.distributed.ray_reaper /tmp/ray/session_<date>_<pid>

It runs by path with no package imported (no ``ray``, no ``torch``): a few MB per watchdog.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead driver whose parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _is_ray_process(pid: int) -> bool:
    """A worker/agent (its title is ``ray::...``) or a Ray binary/script (gcs_server, raylet,
    log_monitor.py, dashboard.py: a path inside the ``ray`` package)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[0].startswith(b"ray::") or any(b"/site-packages/ray/" in a for a in argv[:3])


def _holds_file_under(pid: int, directory: str) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # gone, or another user's process
        return False
    for fd in fds:
        try:
            if os.readlink(os.path.join(fd_dir, fd)).startswith(directory):
                return True
        except OSError:
            continue
    return False


def session_processes(session_dir: str) -> list[int]:
    """Pids of the Ray processes that hold a file of ``session_dir`` open (not this process)."""
    directory = os.path.realpath(session_dir).rstrip("/") + "/"
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    return [p for p in pids if _holds_file_under(p, directory) and _is_ray_process(p)]


def reap(session_dir: str, spare: int | None = None) -> list[int]:
    """SIGKILL the Ray processes of ``session_dir`` (but ``spare``); returns their pids."""
    killed = []
    for pid in session_processes(session_dir):
        if pid == spare:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return killed


def watch(driver_pid: int, raylet_pid: int, session_dir: str) -> None:
    """Wait until the driver or the raylet is gone (a hard kill, or the end of the session),
    then reap the session, sparing the driver (it lives on after ``ray.shutdown()``).  The
    driver is our parent: once it dies we are reparented, which no reuse of its pid can fake.
    A second pass catches a worker that was still starting."""
    while os.getppid() == driver_pid and _alive(raylet_pid):
        time.sleep(POLL_S)
    reap(session_dir, spare=driver_pid)
    time.sleep(2 * POLL_S)
    reap(session_dir, spare=driver_pid)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--watch":
        watch(int(argv[1]), int(argv[2]), argv[3])
        return 0
    if len(argv) == 1 and not argv[0].startswith("-"):
        killed = reap(argv[0])
        print(f"killed {len(killed)} Ray process(es) of {argv[0]}: {killed}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
