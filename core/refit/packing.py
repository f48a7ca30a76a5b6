"""One bucket <-> one flat byte buffer.

Every transport moves a bucket as a single contiguous ``uint8`` buffer plus a layout (name,
dtype, shape, byte offset per tensor): one shared-memory segment, one CUDA IPC handle or one
broadcast per bucket instead of one per tensor.  Offsets are aligned so each tensor can be
viewed in place on the receiving side, without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.refit.manifest import DTYPE_BYTES, RefitError, dtype_name

ALIGN = 256  # bytes; covers every dtype's alignment and keeps vector loads aligned


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in a packed bucket (plain data: crosses any RPC)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_list(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> Slot:
        name, dtype, shape, offset, nbytes = item
        return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))


def plan_layout(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[Slot], int]:
    """Slots for ``(name, tensor)`` pairs and the total buffer size."""
    slots, offset = [], 0
    for name, tensor in items:
        dtype = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * DTYPE_BYTES[dtype]
        slots.append(Slot(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


def pack_into(buffer: torch.Tensor, slots: Sequence[Slot], items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into its slot of ``buffer`` (a uint8 tensor of the planned size)."""
    for slot, (_, tensor) in zip(slots, items, strict=True):
        view_of(buffer, slot).copy_(tensor, non_blocking=True)


def unpack(buffer: torch.Tensor, slots: Sequence[Slot]) -> list[tuple[str, torch.Tensor]]:
    """Views of every tensor in ``buffer`` (no copy; they keep ``buffer``'s storage alive)."""
    return [(slot.name, view_of(buffer, slot)) for slot in slots]


def view_of(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    end = slot.offset + slot.nbytes
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < end:
        raise RefitError(f"bucket buffer too small for {slot.name!r}: needs {end} bytes, has {buffer.numel()}")
    return buffer[slot.offset : end].view(getattr(torch, slot.dtype)).view(slot.shape)


def as_torch(array: Any) -> torch.Tensor:
    """A torch view of a refit tensor: torch tensors pass through, numpy arrays (the JAX
    backend's host-gathered weights, bfloat16 included) are wrapped without a copy."""
    if isinstance(array, torch.Tensor):
        return array
    import numpy as np

    shape = np.shape(array)
    array = np.ascontiguousarray(array).reshape(shape)  # ascontiguousarray makes 0-d arrays 1-d
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: same bits as torch.bfloat16
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)
