"""The frozen reference policy: its weights live in host memory and are swapped in on demand.

Only this rank's *local shards* are kept (FSDP flat-parameter shards, DTensor local
tensors), so the reference costs 1/world of the model per rank, and swapping is a local
copy with no communication.  ``swapped_in`` exchanges the two sets of weights through one
host staging buffer and restores the policy weights even if the body raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p.data


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors that hold this rank's part of the weights (DTensor local shards, or the
    parameters themselves)."""
    return [_local(p) for p in model.parameters()]


class ReferenceWeights:
    """A host copy of a model's local weight shards, captured at construction.

    ``shards`` is a callable returning the tensors that *store* this rank's weights (what a
    forward pass reads): DTensor local tensors for FSDP2, the flat parameters for FSDP1.
    It is called again at every swap, because wrappers may re-point their storage.
    """

    def __init__(self, shards: Callable[[], list[torch.Tensor]], pin_memory: bool = False) -> None:
        self._shards = shards
        with torch.no_grad():
            self._host = [self._to_host(t, pin_memory) for t in shards()]
        # Staging for the policy weights while the reference is swapped in (allocated lazily).
        self._stash: list[torch.Tensor] | None = None

    @staticmethod
    def _to_host(t: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin_memory and t.is_cuda)
        return out.copy_(t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model computes with the reference weights."""
        with torch.no_grad():
            if self._stash is None:
                self._stash = [torch.empty_like(t) for t in self._host]
            for local, ref, stash in zip(self._shards(), self._host, self._stash, strict=True):
                stash.copy_(local)
                local.copy_(ref, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for local, stash in zip(self._shards(), self._stash, strict=True):
                    local.copy_(stash, non_blocking=True)
