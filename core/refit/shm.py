"""CPU ``ipc`` transport: a bucket in a POSIX shared-memory file.

The sender packs the bucket into ``/dev/shm/<name>`` (one copy, from the gathered full
tensors); every engine worker on the host maps the same file with ``torch.from_file`` and
views the tensors in place.  The mapping lives as long as a view does, so a layer vLLM is
still assembling keeps its bytes after the sender unlinks the name.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any, Sequence

import torch

from core.refit.packing import Slot, pack_into, plan_layout, unpack

KIND = "shm"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmBucketWriter:
    """Owns at most one live segment: writing the next bucket unlinks the previous one."""

    def __init__(self, prefix: str = "dualrl-refit") -> None:
        self._prefix = prefix
        self._path: str | None = None

    def write(self, items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        self.release()
        slots, total = plan_layout(items)
        path = os.path.join(_shm_dir(), f"{self._prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self._path = path
        pack_into(buffer, slots, [(n, t.detach().cpu()) for n, t in items])
        del buffer  # the file holds the bytes; the engine maps it read-only by name
        return {"kind": KIND, "path": path, "nbytes": total, "slots": [s.to_list() for s in slots]}

    def release(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None


def open_bucket(handle: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Map a segment written by ``ShmBucketWriter`` and view its tensors (no copy)."""
    path, nbytes = handle["path"], int(handle["nbytes"])
    if not os.path.exists(path):
        raise FileNotFoundError(f"refit shared-memory segment {path} is gone (was the bucket already released?)")
    buffer = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    return unpack(buffer, [Slot.from_list(s) for s in handle["slots"]])
