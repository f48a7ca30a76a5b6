"""Byte-bounded buckets over a refit stream.

A bucket is the unit one transport call moves (one shared-memory segment, one CUDA IPC
buffer, one broadcast).  Buckets never reorder the stream: the engine loads weights in the
order the policy yields them, which keeps each decoder layer's parts close together.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from core.refit.manifest import RefitError, RefitManifest

T = TypeVar("T")

GB = 1024**3


def buffer_bytes(refit_buffer_size_gb: float | None, default_gb: float = 1.0) -> int:
    """``refit_buffer_size_gb`` (config field or call argument) in bytes; must be positive."""
    size = default_gb if refit_buffer_size_gb is None else refit_buffer_size_gb
    if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"refit_buffer_size_gb must be a positive number of GB, got {size!r}")
    return max(1, int(size * GB))


def bucket_budget(configured_gb: float, override_gb: float | None = None) -> int:
    """Bytes per bucket: a call's ``refit_buffer_size_gb`` argument, else the policy config's."""
    return buffer_bytes(override_gb if override_gb is not None else configured_gb)


def plan_buckets(manifest: RefitManifest, max_bytes: int) -> list[list[str]]:
    """Consecutive runs of names whose total size stays within ``max_bytes``.

    A tensor larger than ``max_bytes`` is not split (the engine loads whole tensors): it
    travels alone in a bucket of its own.
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, spec in manifest.specs.items():
        size = spec.nbytes
        if current and used + size > max_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        buckets.append(current)
    return buckets


def take_bucket(stream: Iterator[tuple[str, T]], keys: Sequence[str]) -> list[tuple[str, T]]:
    """The next ``len(keys)`` items of ``stream``, which must carry exactly ``keys`` in order."""
    items: list[tuple[str, T]] = []
    for want in keys:
        try:
            name, tensor = next(stream)
        except StopIteration:
            raise RefitError(
                f"refit stream ended before {want!r}: buckets asked for more than the policy has"
            ) from None
        if name != want:
            raise RefitError(
                f"refit bucket asked for {want!r} but the stream is at {name!r}: "
                "buckets must be requested in the order prepare_weights_for_ipc returned"
            )
        items.append((name, tensor))
    return items


def bucket_sizes(plan: Iterable[Sequence[str]], manifest: RefitManifest) -> list[int]:
    return [sum(manifest[n].nbytes for n in bucket) for bucket in plan]
