"""What a process really used, read from ``/proc`` (Linux): CPU seconds, threads, allowed cores,
resident memory and its peak.  Measured, not assumed: a benchmark reports what its workers ran on."""

from __future__ import annotations

import collections
import os

#: Name of the threads of XLA:CPU's intra-op pool (where the compiled programs run).
XLA_POOL_THREAD = "tf_XLAEigen"


def cpu_seconds(pids) -> float | None:
    """User + system CPU seconds of these processes (all their threads) so far."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def thread_names(pid: int) -> collections.Counter:
    """``{thread name: how many}`` of a process (empty when it cannot be read)."""
    names: collections.Counter = collections.Counter()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names[f.read().strip()] += 1
            except OSError:
                pass  # thread gone meanwhile
    except OSError:
        pass
    return names


def allowed_cpus(pid: int) -> int | None:
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin_process(pid: int, cpus: set[int]) -> None:
    """Restrict every current thread of ``pid`` to ``cpus`` (new threads inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # thread gone meanwhile


def status_bytes(pid: int | str, *keys: str) -> dict[str, int] | None:
    """``{key: bytes}`` of ``/proc/<pid>/status`` fields in kB (``VmRSS``, ``VmHWM``); None when
    the process is gone or a field is missing."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = int(value.split()[0]) * 1024
    return out if len(out) == len(keys) else None


def peak_rss_bytes(pid: int | str) -> int | None:
    """The high-water mark of a process's resident memory (``VmHWM``), or None if unreadable."""
    values = status_bytes(pid, "VmHWM")
    return values["VmHWM"] if values else None


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
