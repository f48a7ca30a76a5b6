"""What each torch backend (FSDP1, DTensor) supplies to the shared ``TorchPolicyWorker``: how it
splits the world, wraps the model, measures the gradient norm, gathers full weights, and skips
per-micro-batch collectives."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch

from core.parallel_dims import ParallelDims


class TorchShardingHooks(abc.ABC):
    """The hooks a torch backend's worker class implements."""

    @abc.abstractmethod
    def _parallel_dims(self) -> ParallelDims:
        """The (dp, cp, tp) split of the world."""

    @abc.abstractmethod
    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap/shard the HF module; returns the module to call."""

    @abc.abstractmethod
    def _activation_checkpointing(self) -> bool:
        """Whether the config asks for activation checkpointing."""

    @abc.abstractmethod
    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip to ``max_norm`` (None: only measure); the global norm, equal on every rank, as
        a 0-d device tensor (read on the host with the step's other values)."""

    @abc.abstractmethod
    def _no_gradient_sync(self) -> contextlib.AbstractContextManager:
        """Around a micro batch's forward + backward that is not the step's last: gradients
        accumulate locally, unreduced (the last micro batch's backward reduces the sum)."""

    @abc.abstractmethod
    def _keep_params_gathered(self) -> contextlib.AbstractContextManager:
        """Around a no-grad pass over several micro batches: each wrapped unit gathers its
        parameters once and keeps them until the block ends (then every copy is freed)."""

    @abc.abstractmethod
    def _keep_params_gathered_in_training(self) -> contextlib.AbstractContextManager:
        """Around a train call's micro batches when their gradient reduction is deferred
        (``_no_gradient_sync`` on all but the last): each wrapped unit gathers its parameters
        once and keeps them through every forward and backward (then every copy is freed)."""

    @abc.abstractmethod
    def _iter_stored_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(name, full tensor)`` of every stored weight (``_stored_meta``: with
        LoRA the adapters too) not in ``skip``, on every rank."""

    @abc.abstractmethod
    def _reshard_all(self) -> None:
        """Free every gathered (unsharded) parameter copy."""

    @property
    def _offloading(self) -> bool:
        """Whether parameter CPU offload is on (backends with such an option override this)."""
        return False
