"""GPU ``ipc`` transport: a bucket in one CUDA buffer, shared by a CUDA IPC handle.

Colocated training and engine processes sit on the same GPUs.  Every training rank packs the
bucket into a buffer on its own GPU and returns the handle keyed by that GPU's UUID; each
engine worker opens the handle of the GPU it runs on, so bytes never leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.refit.packing import Slot, pack_into, plan_layout, unpack

KIND = "cuda_ipc"


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIpcBucketWriter:
    """Keeps the exported buffer alive until the next bucket (the engine reads it in place)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def write(self, items: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        self.release()
        slots, total = plan_layout(items)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        pack_into(buffer, slots, items)
        torch.cuda.current_stream(device).synchronize()  # the importer reads on another stream
        self._buffer = buffer
        _, args = reduce_tensor(buffer)
        return {"kind": KIND, "handles": {device_uuid(device): list(args)}, "slots": [s.to_list() for s in slots]}

    def release(self) -> None:
        self._buffer = None


def merge_handles(per_rank: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One handle dict from every training rank's (one entry per GPU)."""
    present = [h for h in per_rank if h is not None]
    merged = dict(present[0])
    merged["handles"] = {uuid: args for h in present for uuid, args in h["handles"].items()}
    return merged


def open_bucket(handle: dict[str, Any], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = device_uuid(device)
    if uuid not in handle["handles"]:
        raise RuntimeError(
            f"no CUDA IPC handle for this engine's GPU {uuid}; handles exist for "
            f"{sorted(handle['handles'])}: the ipc transport needs colocated placement "
            "(use transport='collective' otherwise)"
        )
    args = list(handle["handles"][uuid])
    args[6] = device.index  # reduce_tensor records the sender's device index; ours may differ
    buffer = rebuild_cuda_tensor(*args)
    return unpack(buffer, [Slot.from_list(s) for s in handle["slots"]])
