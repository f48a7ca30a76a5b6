"""Process-group start-up and device facts for a torch worker inside a Ray actor.

The worker group sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``
(see ``core.distributed.RayWorkerGroup``), so ``env://`` initialisation works as is.
NCCL on GPU, gloo on CPU; the timeout is short enough that a peer that died outside a
Ray call (e.g. OOM-killed mid-collective) surfaces as an error rather than a long hang.
"""

from __future__ import annotations

import os
import platform
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: Collective timeout (seconds); override with DUALRL_COLLECTIVE_TIMEOUT_S.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600


def init_torch_distributed() -> torch.device:
    """Join the default process group (idempotent) and return this rank's device."""
    device = local_device()
    if not dist.is_initialized():
        timeout = float(os.environ.get("DUALRL_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), **kwargs)
    return device


def local_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when this actor was given a GPU, else ``cpu``.

    Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU(s), so the local index is usually 0.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def device_id(device: torch.device) -> str:
    """A string that identifies the physical device: the GPU UUID, or host:pid on CPU."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return f"cpu:{socket.gethostname()}:{os.getpid()}"


def device_info(device: torch.device) -> dict[str, Any]:
    """Memory and identity facts for ``get_gpu_info``; honest CPU facts on CPU machines."""
    info: dict[str, Any] = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device_type": device.type,
        "device_id": device_id(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            total_memory_bytes=props.total_memory,
            memory_allocated_bytes=torch.cuda.memory_allocated(device),
            memory_reserved_bytes=torch.cuda.memory_reserved(device),
            peak_memory_allocated_bytes=torch.cuda.max_memory_allocated(device),
        )
    else:
        info.update(
            device_name=platform.processor() or platform.machine(),
            cpu_count=os.cpu_count(),
            torch_num_threads=torch.get_num_threads(),
            rss_bytes=_rss_bytes(),
            peak_rss_bytes=_peak_rss_bytes(),
        )
    return info


def reset_peak_memory(device: torch.device) -> None:
    """Reset the peak-memory counter (CUDA allocator, or the process's RSS high-water mark)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        try:  # "5" resets VmHWM (Linux >= 4.0); harmless if not permitted
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def resident_on(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` (any index of its type
    when ``device`` names none)."""

    def on(t: torch.Tensor) -> bool:
        return t.device.type == device.type and (device.index is None or t.device.index == device.index)

    return all(on(t) for t in (*model.parameters(), *model.buffers()))


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss_bytes() -> int | None:
    return _status_kib("VmRSS")


def _peak_rss_bytes() -> int | None:
    return _status_kib("VmHWM")
