"""CPU ``ipc`` transport: a bucket in a POSIX shared-memory file.

The sender packs the bucket into ``/dev/shm/<name>`` (one copy, from the gathered full
tensors); every engine worker on the host maps the same file with ``torch.from_file`` and
views the tensors in place.  The mapping lives as long as a view does, so a layer vLLM is
still assembling keeps its bytes after the sender unlinks the name.

Segments outlive their writer unless someone unlinks them (``/dev/shm`` is RAM), so:

* a writer unlinks its segment when packing fails and when its process exits normally
  (``atexit``);
* a process killed hard runs neither, so :func:`sweep_stale_segments` -- run whenever a
  writer is created, and callable at policy shutdown -- removes the segments whose owner
  process is gone.  A segment is named ``<prefix>-<pid>-p<pid namespace>-<uuid>``: the owner
  counts as gone only if ``pid`` in *our* pid namespace does not exist, is a zombie, or
  started after the segment was last written (the pid was reused).  Segments of live
  processes, of other runs included, and of other pid namespaces are left alone.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from core.refit.manifest import RefitError
from core.refit.packing import Slot, plan_layout, unpack

KIND = "shm"
DEFAULT_PREFIX = "dualrl-refit"
#: A segment last written this many seconds before its pid's process started is stale (the
#: pid was reused).  The margin covers the 1 s resolution of the boot time in /proc/stat and
#: small clock steps; a pid reused sooner than this only delays the clean-up to that
#: process's own end.
PID_REUSE_MARGIN_S = 30.0

# path -> pid of the process that created it.  A forked child inherits this dict; it must
# not unlink its parent's live segments when it exits, hence the pid.
_LIVE_SEGMENTS: dict[str, int] = {}


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where /proc has none): pids are only
    comparable between processes of the same namespace (containers sharing /dev/shm)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(prefix: str = DEFAULT_PREFIX, pid: int | None = None, namespace: int | None = None) -> str:
    """A fresh segment name owned by ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    namespace = _pid_namespace() if namespace is None else namespace
    return f"{prefix}-{pid}-p{namespace}-{uuid.uuid4().hex[:12]}"


def _parse(name: str, prefix: str) -> tuple[int, int | None] | None:
    """``(pid, namespace)`` of one of our segment names; namespace None for the older
    ``<prefix>-<pid>-<uuid>`` names (written before namespaces were recorded); else None."""
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)-(?:p(\d+)-)?([0-9a-f]{12})", name)
    if match is None:
        return None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start of ``pid`` from /proc (None if it does not exist; +inf for a zombie,
    which will never touch its segments again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces and ')'
    if fields[0] in ("Z", "X"):
        return float("inf")
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _owner_gone(pid: int, last_write: float) -> bool:
    if not os.path.isdir("/proc"):  # no /proc (macOS): existence only, no reuse check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    started = _process_start_time(pid)
    return started is None or started > last_write + PID_REUSE_MARGIN_S


def sweep_stale_segments(directory: str | None = None, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink the segments in ``directory`` (default: the shm dir) whose owner process is
    gone (see the module doc); returns the removed paths.  Never raises for one segment:
    another process may sweep or release it at the same moment, or own it as another user."""
    directory = directory or _shm_dir()
    namespace = _pid_namespace()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        owner = _parse(name, prefix)
        if owner is None or owner[1] not in (None, namespace):
            continue
        path = os.path.join(directory, name)
        try:
            if _owner_gone(owner[0], os.stat(path).st_mtime):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def _unlink(path: str) -> None:
    _LIVE_SEGMENTS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _release_at_exit() -> None:
    for path, owner in list(_LIVE_SEGMENTS.items()):
        if owner == os.getpid():
            _unlink(path)


class ShmBucketWriter:
    """Owns at most one live segment: writing the next bucket unlinks the previous one."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, directory: str | None = None) -> None:
        self._prefix = prefix
        self._dir = directory or _shm_dir()
        self._path: str | None = None
        # A writer starts once per worker: the moment to clear what killed ranks left behind.
        sweep_stale_segments(self._dir, prefix)

    def write(self, items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        self.release()
        slots, total = plan_layout(items)
        path = os.path.join(self._dir, segment_name(self._prefix))
        # Registered before the file exists: from_file may create it and then fail.
        self._path = path
        _LIVE_SEGMENTS[path] = os.getpid()
        try:
            _write_segment(path, total, slots, [t for _, t in items])
        except BaseException:
            self.release()  # a half-written bucket is of no use to anyone
            raise
        return {"kind": KIND, "path": path, "nbytes": total, "slots": [s.to_list() for s in slots]}

    def release(self) -> None:
        if self._path is not None:
            _unlink(self._path)
            self._path = None


def _write_segment(path: str, total: int, slots: Sequence[Slot], tensors: Sequence[torch.Tensor]) -> None:
    """A new file of ``total`` bytes with each tensor's bytes at its slot, by ``pwrite``: the
    kernel allocates the file's pages as it copies, where writing through a mapping takes a
    page fault per 4 KiB page (about twice the time for a 100 MB bucket, docs/results.md), and
    a full shm directory is an error here, not a SIGBUS in the middle of a copy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)  # the alignment gaps read as zeros
        for slot, tensor in zip(slots, tensors, strict=True):
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
            written = 0
            while written < slot.nbytes:
                written += os.pwrite(fd, data[written:], slot.offset + written)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise RefitError(
            f"refit bucket of {total} bytes does not fit in {os.path.dirname(path)} ({exc.strerror}): "
            "free space there or lower policy.refit_buffer_size_gb"
        ) from exc
    finally:
        os.close(fd)


def open_bucket(handle: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Map a segment written by ``ShmBucketWriter`` and view its tensors (no copy)."""
    path, nbytes = handle["path"], int(handle["nbytes"])
    if not os.path.exists(path):
        raise FileNotFoundError(f"refit shared-memory segment {path} is gone (was the bucket already released?)")
    buffer = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    return unpack(buffer, [Slot.from_list(s) for s in handle["slots"]])
