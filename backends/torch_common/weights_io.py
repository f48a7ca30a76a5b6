"""The torch workers' weights in and out (mixed into ``TorchPolicyWorker``): the full-weight
stream (LoRA merged) that refit, generation and the HF export read, DCP checkpoints, the HF
export's weights, and the refit metadata and streams (full, LoRA base, LoRA adapters)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from backends.torch_common import checkpoint as ckpt
from backends.torch_common.model_loading import as_torch_dtype
from core.models.lora import is_adapter_name, merge_adapter_stream
from core.refit.checkpoint_names import checkpoint_refit_info, checkpoint_weights

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler


class TorchWeightsIO:
    """Full weights, checkpoints and refit streams over the backend's ``_iter_stored_weights``."""

    model: torch.nn.Module
    hf_module: torch.nn.Module
    rank: int
    train_step: int
    optimizer: torch.optim.Optimizer | None
    scheduler: LRScheduler | None
    lora_modules: list[str]  # adapted module names
    lora_scale: float
    param_meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    _stored_meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    _refit_skip: frozenset[str]

    if TYPE_CHECKING:  # the backend's (sharding_hooks.TorchShardingHooks)

        def _iter_stored_weights(
            self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
        ) -> Iterator[tuple[str, torch.Tensor]]: ...

        def _reshard_all(self) -> None: ...

    def iter_full_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: yield ``(hf_name, full tensor)`` for every HF weight, on every rank;
        with LoRA each adapted weight merged (``W + scale * B @ A``, in the stored float32,
        then cast) and the adapters left out."""
        if not self.lora_modules:
            yield from self._iter_stored_weights(dtype, skip)
            return
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(as_torch_dtype(dtype)))
        yield from merge_adapter_stream(self._iter_stored_weights(None, skip), self.lora_modules, self.lora_scale, cast)

    # ------------------------------------------------------------------ checkpoint hooks
    def _save_state(self, weights_path: str, optimizer_path: str | None) -> None:
        """DCP shards of the model (and optimizer + scheduler + step)."""
        extra: dict[str, Any] = {"train_step": self.train_step}
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        ckpt.save_dcp(self.model, weights_path, self.optimizer, optimizer_path, extra, train_step=self.train_step)

    def _load_state(self, weights_path: str, optimizer_path: str | None, checksums: bool, what: str) -> int | None:
        """Verified DCP load (manifest, kinds, scheduler file, keys and shapes checked on rank 0
        before any shard is read)."""
        self._reshard_all()  # the load writes shards; no stale gathered copy may survive
        extra = ckpt.load_dcp(self.model, weights_path, self.optimizer, optimizer_path, checksums=checksums, what=what)
        if "scheduler" in extra and self.scheduler is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        return extra.get("train_step")

    def _write_hf_weights(self, path: str) -> None:
        state = {}
        for name, tensor in self.iter_full_weights():
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            ckpt.write_hf_checkpoint(self.hf_module, state, path)

    def _wait_for_rank_zero(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------------ refit hooks (source side)
    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (full shape, dtype) of every weight the refit stream will carry (tied
        aliases left out: the engine's receiver loads them from the weight they share), in
        the checkpoint format: fused experts one tensor per expert (``core.refit.checkpoint_names``)."""
        return checkpoint_refit_info({n: meta for n, meta in self.param_meta.items() if n not in self._refit_skip})

    def _refit_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        return checkpoint_weights(self.iter_full_weights(dtype, skip=self._refit_skip))

    def _stored_order(self) -> list[str]:
        """Stored weight names in the order ``_iter_stored_weights`` yields them."""
        return list(self._stored_meta)

    def _iter_base_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        adapters = frozenset(n for n in self._stored_meta if is_adapter_name(n))
        cast = None if dtype is None else as_torch_dtype(dtype)
        return checkpoint_weights(self._iter_stored_weights(cast, self._refit_skip | adapters))

    def _adapter_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: self._stored_meta[n] for n in self._stored_order() if is_adapter_name(n)}

    def _iter_adapter_tensors(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        cast = None if dtype is None else as_torch_dtype(dtype)
        return self._iter_stored_weights(cast, skip=frozenset(self.param_meta))
