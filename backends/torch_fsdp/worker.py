"""``FSDP1PolicyWorker``: the shared torch worker with PyTorch FSDP1 (``FullyShardedDataParallel``).

What is FSDP1-specific: the wrapping (one FSDP unit per transformer block, mixed precision,
optional parameter CPU offload), FSDP1's own global-norm clipping over flat parameters,
gathering full weights unit by unit (``full_weights.py``), and how per-micro-batch
collectives are skipped (``no_sync``; keeping units gathered through a get_logprobs call).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from backends.torch_common.layers import decoder_layer_classes
from backends.torch_common.model_loading import as_torch_dtype
from backends.torch_common.torch_private import flat_param_handles, handles_kept_gathered, reshard_gathered
from backends.torch_common.worker import TorchPolicyWorker
from backends.torch_fsdp.full_weights import UnitPlan
from core.parallel_dims import ParallelDims
from core.refit.checkpoint_names import checkpoint_refit_info


class FSDP1PolicyWorker(TorchPolicyWorker):
    """One rank of an FSDP1 policy: every rank is data parallel (dp = world size)."""

    model: FSDP  # what ``_parallelize`` wraps the HF module in

    def _parallel_dims(self) -> ParallelDims:
        multiple = self.cfg.make_vocab_size_divisible_by or 1
        if multiple > 1:
            # No tensor parallelism here, so nothing needs a padded vocabulary: refuse rather
            # than accept and ignore it (the config check says the same on the driver).
            raise ValueError(
                f"policy.make_vocab_size_divisible_by={multiple}: the torch_fsdp (FSDP1) backend does not "
                "pad the vocabulary; set it to 1 (torch_dtensor and jax_pjit pad)"
            )
        return ParallelDims(self.world_size, fsdp=-1)

    def _activation_checkpointing(self) -> bool:
        return bool(self.cfg.activation_checkpointing)

    @property
    def _offloading(self) -> bool:
        return self._offload_params(bool(self.cfg.cpu_offload), "policy.cpu_offload")

    def _parallelize(self, model: torch.nn.Module) -> FSDP:
        mixed = None
        if self.compute_dtype != torch.float32:
            # fp32 master weights and gradient reduction; compute in the configured dtype.
            mixed = MixedPrecision(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            )
        with warnings.catch_warnings():
            # LoRA freezes the base weights inside every unit: FSDP1 warns that such a unit's
            # frozen weights keep no memory saving (expected: they are a small share).
            warnings.filterwarnings("ignore", message=".*requires_grad.*", category=UserWarning)
            return self._wrap(model, mixed)

    def _wrap(self, model: torch.nn.Module, mixed: MixedPrecision | None) -> FSDP:
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy(decoder_layer_classes(model)),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=self._offloading),
            device_id=self.device,  # explicit: FSDP1 only runs on CPU when told so
            use_orig_params=True,  # optimizer and reference swap see the HF parameters
            limit_all_gathers=True,
        )

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        # FSDP1 gradients are flat local shards: its own clip all-reduces the squared norms.
        limit = max_norm if max_norm is not None else math.inf
        return self.model.clip_grad_norm_(limit)

    @property
    def _unit_plan(self) -> UnitPlan:
        if getattr(self, "_plan", None) is None:
            self._plan = UnitPlan(self.model, self._stored_meta)
        return self._plan

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Metadata only, in the order ``iter_full_weights`` gathers (unit by unit); tied
        aliases left out, as the refit stream leaves them out; fused experts one per expert,
        as the stream splits them (``core.refit.checkpoint_names``)."""
        return checkpoint_refit_info(
            {
                name: self.param_meta[name]
                for name in self._unit_plan.order
                if name in self.param_meta and name not in self._refit_skip
            }
        )

    def _stored_order(self) -> list[str]:
        return list(self._unit_plan.order)

    def _iter_stored_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._unit_plan.iter_weights(None if dtype is None else as_torch_dtype(dtype), skip)

    @contextlib.contextmanager
    def _no_gradient_sync(self):
        if self.compute_dtype != torch.float32:
            # Under no_sync FSDP1 accumulates the unsharded gradients in the compute dtype
            # (its mixed precision casts to reduce_dtype only when it reduces): bf16 sums over
            # micro batches would lose precision the fp32 shard accumulation keeps.  So with
            # mixed precision every micro batch still reduce-scatters.
            yield
            return
        with self.model.no_sync():
            yield

    @contextlib.contextmanager
    def _keep_params_gathered(self):
        # FSDP1 has no public switch for resharding after forward (torch_private): the call
        # runs with the sharded handles marked SHARD_GRAD_OP (gathered once, kept), then the
        # strategy is restored and every gathered copy freed.
        handles = [h for h in flat_param_handles(self.model) if h.uses_sharded_strategy]
        try:
            with handles_kept_gathered(handles):
                yield
        finally:
            self._reshard_all()

    def _keep_params_gathered_in_training(self):
        # The same marking: under no_sync FSDP1 frees a unit after backward only for the
        # reshard-after-forward strategies, so a SHARD_GRAD_OP unit stays gathered through
        # the deferred micro batches; the last (synced) backward frees it as it reduces.
        return self._keep_params_gathered()

    def _local_weight_shards(self) -> list[torch.Tensor]:
        # The flat parameters are what FSDP1 all-gathers for a forward pass; the HF-named
        # parameters (use_orig_params) are views FSDP re-points, not stable storage.
        self._reshard_all()
        return [h.flat_param.data for h in flat_param_handles(self.model)]

    def _reshard_all(self) -> None:
        # FSDP1 never reshards the root after forward and has no public reshard call.
        reshard_gathered(self.model)


if TYPE_CHECKING:  # the type checker holds this worker to the driver's contract
    from core.policy.worker_protocol import PolicyWorker

    _contract: type[PolicyWorker] = FSDP1PolicyWorker
