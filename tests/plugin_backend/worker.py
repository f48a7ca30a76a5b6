"""``EagerPolicyWorker``: the ``eager_torch`` backend's worker, one unsharded eager torch module.

Everything the driver calls (``core.policy.worker_protocol.PolicyWorker``) comes from the shared
skeleton (``core.policy.worker_base.PolicyWorkerBase``: train loop, logprob and generate
preparation, offload states, checkpoints and HF / PEFT export, adapter refit, profiling,
shutdown, input checks) with the torch engine's hooks (``backends.torch_common.worker.
TorchPolicyWorker``: forward, backward, optimizer, DCP checkpoints, device moves).  What a
backend adds is how it shards: here, not at all -- the hooks below are those of a plain module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from backends.torch_common.model_loading import as_torch_dtype
from backends.torch_common.worker import TorchPolicyWorker
from core.parallel_dims import ParallelDims


class EagerPolicyWorker(TorchPolicyWorker):
    """The only rank of an ``eager_torch`` policy (the spec refuses any other world size)."""

    def _parallel_dims(self) -> ParallelDims:
        return ParallelDims(self.world_size, fsdp=-1)

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)  # no wrapper: the HF module is what runs

    def _activation_checkpointing(self) -> bool:
        return bool(self.cfg.activation_checkpointing)

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = max_norm if max_norm is not None else math.inf
        return torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)

    def _no_gradient_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # one rank: gradients are never reduced

    def _keep_params_gathered(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing is ever sharded

    def _keep_params_gathered_in_training(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing is ever sharded

    def _iter_stored_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        state = self.model.state_dict()
        for name in (n for n in self._stored_meta if n not in skip):
            tensor = state[name].detach()
            yield name, tensor if dtype is None else tensor.to(as_torch_dtype(dtype))

    def _reshard_all(self) -> None:
        """Nothing is gathered, so nothing is freed."""


if TYPE_CHECKING:  # the type checker holds this worker to the driver's contract
    from core.policy.worker_protocol import PolicyWorker

    _contract: type[PolicyWorker] = EagerPolicyWorker
