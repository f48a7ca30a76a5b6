"""The JAX backend's models: one module per family, one registry of HF ``model_type``s.

* ``config``   -- ``ModelConfig``, the architecture every family is built from;
* ``layers``   -- what families share: RMSNorm, RoPE, attention, MLP, embedding, the
  activation-sharding hook (``constrain``);
* ``llama``    -- the Llama-family decoder (llama, qwen2, qwen3, mistral);
* ``qwen3_moe`` -- that decoder with mixture-of-experts MLPs (qwen3_moe);
* ``gemma3``   -- the Gemma 3 text decoder (gemma3_text: sliding/full layers, sandwich norms);
* ``hf_table`` -- the row type of a family's HF name table.

A new family is one new module plus one row of ``MODEL_TYPES``.  A family module provides
``config_from_hf(hf_config, model_type, family) -> ModelConfig`` (refusing what it does not
implement), ``CausalLM`` (the flax module: ``__call__``, ``init_cache``, ``decode``, and the
``_embed`` / ``layers`` / ``_logits`` pieces ``generate`` prefills with) and
``HF_TABLES`` (family -> its ``hf_table.Row``s, read by ``hf_mapping``).  A family that
needs architecture fields ``ModelConfig`` lacks declares a frozen dataclass subclass of it in
its own module (``dataclasses.replace``, hashing and the jit cache keep working).

The helpers below work on any family's model: parameters and their logical axes, a pure
``apply_fn`` for jitted steps, abstract models and parameter shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from backends.jax_pjit.models import gemma3, llama, qwen3_moe
from backends.jax_pjit.models.config import SUPPORTED_ROPE_TYPES, ModelConfig


class ModelFamily(NamedTuple):
    """A registry row: our family name (``ModelConfig.family``) and the module implementing it."""

    name: str
    module: ModuleType


#: HF ``model_type`` -> the family that serves it.  Mistral is Llama with a sliding window; it
#: is accepted only when the window never binds (checked in ``llama.config_from_hf``); so is
#: Qwen3's.  Qwen3 (dense) is the Llama decoder with per-head q/k norms (``ModelConfig.qk_norm``).
MODEL_TYPES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", llama),
    "qwen2": ModelFamily("qwen2", llama),
    "qwen3": ModelFamily("qwen3", llama),
    "qwen3_moe": ModelFamily("qwen3_moe", qwen3_moe),
    "mistral": ModelFamily("llama", llama),
    "gemma3_text": ModelFamily("gemma3", gemma3),
}
#: HF ``model_type``s refused with a reason (near misses of a supported type).
REFUSED_MODEL_TYPES: dict[str, str] = {"gemma3": gemma3.MULTIMODAL_REFUSAL}
#: HF ``model_type`` -> our family.
SUPPORTED_MODEL_TYPES = {model_type: family.name for model_type, family in MODEL_TYPES.items()}
#: Our family -> the module that builds it.
FAMILY_MODULES = {family.name: family.module for family in MODEL_TYPES.values()}


def config_from_hf(hf_config: Any) -> ModelConfig:
    """``ModelConfig.from_hf``: the ``model_type`` looked up here, the rest read by its family's module."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; the JAX backend supports {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    family = MODEL_TYPES[model_type]
    return family.module.config_from_hf(hf_config, model_type, family.name)


def family_module(family: str) -> ModuleType:
    """The module that implements ``family`` (a ``ModelConfig.family``)."""
    if family not in FAMILY_MODULES:
        expected = " or ".join(repr(f) for f in FAMILY_MODULES)
        raise ValueError(f"unsupported model family {family!r}; expected {expected}")
    return FAMILY_MODULES[family]


def params_of(model_or_state: Any) -> nnx.State:
    """The ``nnx.Param`` state of a model (a State is returned as is)."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def logical_axes_tree(model_or_state: Any, *, pure: bool = False) -> Any:
    """The logical axes of every parameter, in the structure of the params pytree.

    Default: an ``nnx.State`` shaped exactly like ``nnx.state(model, nnx.Param)`` whose
    Variables hold a tuple of axis names instead of an array (the way
    ``nnx.get_partition_spec`` returns PartitionSpecs).  Because the params tree is a
    prefix of it, ``jax.tree.map(lambda x, axes: ..., params, logical_axes_tree(params))``
    hands each array its tuple.  ``pure=True`` gives nested plain dicts of tuples matching
    ``nnx.to_pure_dict(params)`` instead.  Either form feeds ``sharding.tree_shardings``
    (which treats tuples as leaves).
    """
    state = params_of(model_or_state)

    def axes_of(var):
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter of shape {var.shape} declares no logical axes")
        return tuple(axes)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if pure:
        return _pure_axes(state, axes_of)
    return jax.tree.map(lambda v: v.replace(axes_of(v)), state, is_leaf=is_var)


def _pure_axes(state: nnx.State, axes_of) -> dict:
    """Nested plain dicts (keys as in ``nnx.to_pure_dict``) of each Variable's axes."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes_of(var)
    return out


def make_apply_fn(model: nnx.Module) -> tuple[Callable, nnx.State]:
    """Split ``model`` into ``(apply_fn, params)`` for pure, jittable steps.

    ``apply_fn(params, input_ids, attention_mask, positions, allowed=None, remat=False) -> logits``
    rebuilds the module from the static graph definition and ``params`` (an ``nnx.State``
    pytree); ``allowed`` and ``remat`` are ``CausalLM.__call__``'s.  With
    ``capture_router=True`` it returns ``(logits, router_logits)``: the sparse layers' router
    logits stacked [sparse layers, B, S, experts] in layer order (None for a dense model).
    ``routing`` [sparse layers, B, S, top_k]: routing replay (``CausalLM.__call__``).
    """
    # flax types a split by two filters as (graphdef, state, *states): here ``rest`` is one state.
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)

    def apply_fn(
        params, input_ids, attention_mask, positions=None, allowed=None, remat=False, capture_router=False, routing=None
    ):
        module = nnx.merge(graphdef, params, *rest)
        kwargs = {} if routing is None else {"routing": routing}  # only a MoE model takes it
        if not capture_router:
            return module(input_ids, attention_mask, positions, allowed, remat, **kwargs)
        forward = nnx.capture(module, nnx.Intermediate)
        logits, sown = forward(input_ids, attention_mask, positions, allowed, remat, **kwargs)
        return logits, _stacked_router_logits(sown)

    return apply_fn, params


def _stacked_router_logits(sown: nnx.State) -> jax.Array | None:
    """The ``ROUTER_LOGITS`` the sparse layers sowed, [layers, B, S, X] in layer order."""
    name = qwen3_moe.ROUTER_LOGITS
    found = {path[1]: value for path, value in nnx.to_flat_state(sown) if path[0] == "layers" and path[-1] == name}
    if not found:
        return None
    # A sow appends to a tuple: one call per layer and forward, so one entry.
    return jnp.stack([_one(found[i]) for i in sorted(found)])


def _one(value: Any) -> jax.Array:
    value = value.get_value() if isinstance(value, nnx.Variable) else value
    return value[0] if isinstance(value, tuple) else value


def abstract_model(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32) -> llama.CausalLM:
    """The ``CausalLM`` of ``cfg.family``, its params ``ShapeDtypeStruct``s (no memory, no init
    compute); fill it with ``hf_mapping.load_hf_weights`` or ``nnx.update``."""
    causal_lm = family_module(cfg.family).CausalLM
    return nnx.eval_shape(lambda: causal_lm(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def param_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    """``{state path: shape}`` of every parameter, e.g. ``("layers", 0, "mlp", "up_proj", "kernel")``."""
    return dict(_param_shapes(cfg))


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: ModelConfig) -> tuple:
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return tuple((tuple(path), tuple(var.shape)) for path, var in nnx.to_flat_state(state))


__all__ = [
    "MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "FAMILY_MODULES",
    "ModelFamily",
    "ModelConfig",
    "config_from_hf",
    "family_module",
    "params_of",
    "logical_axes_tree",
    "make_apply_fn",
    "abstract_model",
    "param_shapes",
]
