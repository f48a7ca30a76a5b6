"""LoRA on the JAX backend: adapters as ``LoRAParam`` leaves of the targeted ``Dense`` layers.

The initial arrays, the scale and the names come from ``core.models.lora`` (HF layout
A [r, in], B [out, r]); here they are laid out like the kernel they adapt -- ``lora_a``
[*in_dims, r] with the kernel's input axes + ``lora_rank``, ``lora_b`` [r, *out_dims] with
``lora_rank`` + its output axes -- so each shards like its half of the kernel and the rank is
replicated.  ``LoRAParam`` is an ``nnx.Param`` subtype: the params tree keeps one structure
(checkpoints, reference, offload unchanged) while the steps split the adapters off by type
(``trainable``): only they are differentiated and only they have optimizer state; the base
kernels stay in their storage dtype, untouched.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from backends.jax_pjit.hf_mapping import expected_entries
from backends.jax_pjit.models.config import ModelConfig
from core.models.lora import adapted_modules, lora_scale
from core.policy.config import LoRAConfig
from core.policy.lora_adapter import starting_adapters


class LoRAParam(nnx.Param):
    """A LoRA adapter weight: with ``policy.lora`` the only parameters that train."""


class Adapted(NamedTuple):
    """One adapted Dense: its HF module path and the JAX path of its kernel."""

    module: str
    kernel_path: tuple


def apply_lora(model: nnx.Module, cfg: ModelConfig, lora: LoRAConfig, resume: bool = False) -> list[Adapted]:
    """Attach the starting adapters (``policy.lora.adapter_path``'s, else the seeded init;
    ``resume``: the seeded init, a checkpoint overwrites it) to every targeted Dense of ``model``."""
    entries = {e.hf_name[: -len(".weight")]: e for e in expected_entries(cfg) if e.hf_name.endswith(".weight")}
    scale = lora_scale(lora.alpha, lora.rank, lora.use_rslora)
    source = starting_adapters(lora, resume)
    adapted = []
    for module in adapted_modules(entries, lora.targets):
        e = entries[module]
        dense = module_at(model, e.jax_path[:-1])
        kernel = dense.kernel
        axes = tuple(kernel.get_metadata()["out_sharding"])
        n_in = dense.n_in
        in_dims, out_dims = e.jax_shape[:n_in], e.jax_shape[n_in:]
        out_flat, in_flat = e.hf_shape
        a, b = source(module, in_flat, out_flat)
        dtype = kernel[...].dtype
        dense.lora_a = LoRAParam(
            jnp.asarray(a.T.reshape(*in_dims, lora.rank), dtype), out_sharding=axes[:n_in] + ("lora_rank",),
            eager_sharding=False,
        )  # fmt: skip
        dense.lora_b = LoRAParam(
            jnp.asarray(b.T.reshape(lora.rank, *out_dims), dtype), out_sharding=("lora_rank",) + axes[n_in:],
            eager_sharding=False,
        )  # fmt: skip
        dense.lora_scale = scale
        adapted.append(Adapted(module, e.jax_path))
    return adapted


def module_at(model: nnx.Module, path: tuple) -> Any:
    """The submodule at a state path such as ``("layers", 0, "self_attn", "q_proj")``."""
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def split_trainable(tree: Any, trainable: Any) -> tuple[Any, Any]:
    """``(adapters, the rest)`` of a params-shaped ``nnx.State`` (params, shardings, axes)."""
    train, frozen = nnx.split_state(tree, trainable, ...)
    return train, frozen


@functools.partial(jax.jit, static_argnums=(3,))
def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``kernel + scale * a . b`` in the JAX layout ([*in, r] . [r, *out] = [*in, *out]):
    ``W + scale * B @ A`` in HF terms; on the devices, each shard where it lies."""
    return kernel + scale * jnp.tensordot(a, b, axes=1).astype(kernel.dtype)


def merged_flat(flat: dict[tuple, Any], adapted: list[Adapted], scale: float) -> dict[tuple, Any]:
    """``flat_values`` of the params with each adapted kernel merged (adapter leaves kept)."""
    out = dict(flat)
    for item in adapted:
        base = item.kernel_path[:-1]
        out[item.kernel_path] = merged_kernel(
            flat[item.kernel_path], flat[base + ("lora_a",)], flat[base + ("lora_b",)], scale
        )
    return out
