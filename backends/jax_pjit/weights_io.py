"""The JAX worker's weights in and out (mixed into ``JaxPolicyWorker``): the full-weight stream in
the HF layout (LoRA merged) that refit reads, the LoRA base and adapter streams, orbax
checkpoints and the HF export's weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax_pjit import checkpoint as jax_ckpt
from backends.jax_pjit.hf_mapping import entry_value, expected_entries, flat_values, save_hf_checkpoint
from backends.jax_pjit.lora import merged_flat, module_at
from backends.jax_pjit.sharding import host_copy, off_device
from core.models.lora import adapter_names

if TYPE_CHECKING:
    from backends.jax_pjit.lora import Adapted
    from backends.jax_pjit.models import ModelConfig
    from core.policy.config import PolicyConfig


class JaxWeightsIO:
    """Full weights, checkpoints and refit streams of the worker's sharded ``params``."""

    cfg: PolicyConfig
    rank: int
    model: Any  # the flax model: a scratch copy the HF export writes from (the steps use params)
    model_cfg: ModelConfig
    hf_config: Any
    params: Any
    opt_state: Any
    lora: list[Adapted]
    lora_scale: float
    train_step: int
    _hf_layout: Callable[..., jax.Array]

    if TYPE_CHECKING:  # the worker's

        def _reload(self, name: str) -> None: ...

        def prepare_for_training(self, *args: Any, **kwargs: Any) -> None: ...

    def iter_full_weights(self, dtype: Any = None, merged: bool = True) -> Iterator[tuple[str, Any]]:
        """``(hf_name, full tensor)`` in the HF layout and ``dtype`` (None: the params'), one
        tensor at a time, in ``expected_entries`` order.

        The HF layout (vocab cut, transpose) and the cast run on the devices, shard by shard
        (``hf_mapping.hf_layout``, one program per distinct shape: every layer shares it); then
        the tensor leaves them once (``sharding.off_device``), rather than the whole fp32 model
        copied to the host and transposed and cast there."""
        self._reload("params")
        flat = flat_values(self.params)
        if self.lora and merged:  # LoRA: each adapted kernel merged (W + scale * B @ A) before the layout
            flat = merged_flat(flat, self.lora, self.lora_scale)
        cast = None if dtype is None else jnp.dtype(dtype)
        for e in expected_entries(self.model_cfg):
            full = self._hf_layout(entry_value(flat, e), e.transform, e.vocab_dim, self.model_cfg.vocab_size, cast)
            yield e.hf_name, off_device(full)

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (HF shape, params' dtype) in stream order: metadata of the HF mapping
        (shapes of the abstract model), no gather and no device -> host copy."""
        dtype = jnp.dtype(self.model.param_dtype).name
        return {e.hf_name: (tuple(e.hf_shape), dtype) for e in expected_entries(self.model_cfg)}

    def _refit_devices(self) -> list:
        """IPC buckets go to every local GPU (each colocated engine worker reads its own);
        on CPU, one host segment."""
        import torch

        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]

    # ------------------------------------------------------------------ LoRA adapter-only refit
    def _iter_base_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        return self.iter_full_weights(dtype, merged=False)

    def _adapter_meta(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """A [r, in] and B [out, r] per adapted module (HF layout), in ``self.lora`` order."""
        dtype, rank = jnp.dtype(self.model.param_dtype).name, self.cfg.lora.rank
        shapes = {e.hf_name[: -len(".weight")]: e.hf_shape for e in expected_entries(self.model_cfg)}
        info: dict[str, tuple[tuple[int, ...], str]] = {}
        for item in self.lora:
            out_flat, in_flat = shapes[item.module]
            name_a, name_b = adapter_names(item.module)
            info[name_a] = ((rank, in_flat), dtype)
            info[name_b] = ((out_flat, rank), dtype)
        return info

    def _iter_adapter_tensors(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """``lora_a`` [*in, r] -> A [r, in] and ``lora_b`` [r, *out] -> B [out, r] (what the HF
        export writes), cast and moved off the devices one at a time."""
        self._reload("params")
        flat = flat_values(self.params)
        cast = jnp.dtype(dtype) if dtype is not None else None
        for item in self.lora:
            base = item.kernel_path[:-1]
            a, b = flat[base + ("lora_a",)], flat[base + ("lora_b",)]
            name_a, name_b = adapter_names(item.module)
            for name, hf in ((name_a, a.reshape(-1, a.shape[-1]).T), (name_b, b.reshape(b.shape[0], -1).T)):
                yield name, off_device(hf if cast is None else hf.astype(cast))

    # ------------------------------------------------------------------ checkpoint hooks
    def _save_state(self, weights_path: str, optimizer_path: str | None) -> None:
        """Orbax: sharded params (and optimizer state + step) for resume; atomic, with a
        manifest (``backends.jax_pjit.checkpoint``)."""
        self.prepare_for_training()  # offloaded state is saved from the mesh, sharded
        jax_ckpt.save_orbax(self.params, self.opt_state, self.train_step, weights_path, optimizer_path)

    def _load_state(self, weights_path: str, optimizer_path: str | None, checksums: bool, what: str) -> int | None:
        """Verified restore: manifests, kinds, and orbax's metadata against the live trees
        (keys and shapes) are checked before any array is read.  Offloaded state comes back to
        the mesh first: it is the live tree the restore checks against and replaces."""
        self.prepare_for_training()
        self.params, self.opt_state, step = jax_ckpt.load_orbax(
            self.params, self.opt_state, weights_path, optimizer_path, checksums=checksums, what=what
        )
        return step

    def _write_hf_weights(self, path: str) -> None:
        """HF safetensors of the params (LoRA merged into the kernels) from ``self.model``."""
        self._reload("params")
        params = host_copy(self.params)  # several processes: a collective, so every one gathers
        if self.rank != 0:
            return
        from flax import nnx

        nnx.update(self.model, params)  # self.model is a scratch copy: the steps use self.params
        if self.lora:
            merged = merged_flat(flat_values(params), self.lora, self.lora_scale)
            for item in self.lora:
                kernel = jnp.asarray(np.asarray(merged[item.kernel_path]))
                module_at(self.model, item.kernel_path[:-1]).kernel.set_value(kernel)
        save_hf_checkpoint(self.model, self.hf_config, path)
