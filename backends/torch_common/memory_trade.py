"""When a torch worker may trade device memory for fewer per-micro-batch collectives.

Holding full-size copies across a call's micro batches -- gathered weights through a
get_logprobs call, unreduced gradients through a global batch -- saves one all-gather or
reduce-scatter per FSDP unit and micro batch, at the price of those copies.  The workers
ask :func:`full_copies_fit` once per call, before the loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist


def full_copies_fit(device: torch.device, n_micro_batches: int, nbytes: int, offloading: bool) -> bool:
    """Whether to hold ``nbytes`` of full-size copies across ``n_micro_batches``.

    Not for one micro batch (nothing to save; only a higher peak), nor under CPU offload
    (it is on because the device is too small).  On CUDA only when the copies take at most
    half of the free device memory (cached blocks included): the micro batches' activations
    need the rest.  Every rank must decide alike (a rank that reshards issues collectives
    the others would not).  The micro-batch count is the same on every rank (fixed sizes
    over equal shards, lockstep dynamic / packing plans), so only free memory can differ:
    on CUDA the answer is the minimum over all ranks, one tiny all-reduce per call.
    """
    ok = n_micro_batches > 1 and not offloading
    if device.type != "cuda":
        return ok
    if ok:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        ok = nbytes <= (free + cached) / 2
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())  # before the loop: nothing is queued behind it yet
    return ok


def weight_bytes(param_meta: Mapping[str, tuple[tuple[int, ...], object]], dtype: torch.dtype) -> int:
    """Bytes of every weight, unsharded, in ``dtype`` (an upper bound of a rank's share under TP)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape, _ in param_meta.values()) * itemsize
