"""Per-step AdamW settings on the JAX backend (``Policy.set_optimizer_params``).

The learning rate is data in the optimizer state (``optax.inject_hyperparams``), so a new one
costs nothing; the other settings are constants of the compiled update, so a change rebuilds
the optax chain (one recompile).  Adam's moments carry over: the new chain's state has the
old one's arrays, in the new structure (the chains differ only in stateless parts, such as
clipping or weight decay turned on).
"""

from __future__ import annotations

from typing import Any

import jax

from core.policy.config import OptimizerConfig, PolicyConfig
from core.policy.optimizer_params import ADAMW, AdamWParams

__all__ = ["AdamWParams", "rebuilt_optimizer", "transplanted_state", "with_adamw_params"]


def with_adamw_params(cfg: PolicyConfig, params: AdamWParams) -> PolicyConfig:
    """``cfg`` whose optimizer section and gradient clipping are ``params``."""
    optimizer = OptimizerConfig(name=ADAMW, kwargs=params.optimizer_kwargs())
    return cfg.model_copy(update={"optimizer": optimizer, "max_grad_norm": params.max_grad_norm})


def transplanted_state(tx: Any, old_state: Any, trainable_params: Any) -> Any:
    """``old_state``'s arrays in the structure ``tx.init`` gives ``trainable_params``.

    ValueError when the two states do not hold the same arrays (another optimizer family)."""
    target = jax.eval_shape(tx.init, trainable_params)
    new_leaves, old_leaves = jax.tree.leaves(target), jax.tree.leaves(old_state)
    same = len(new_leaves) == len(old_leaves) and all(
        n.shape == o.shape and n.dtype == o.dtype for n, o in zip(new_leaves, old_leaves, strict=True)
    )
    if not same:
        raise ValueError(
            "set_optimizer_params: the new AdamW settings give an optimizer state of another shape "
            f"({len(new_leaves)} arrays, was {len(old_leaves)}); the moments cannot carry over"
        )
    return jax.tree.unflatten(jax.tree.structure(target), old_leaves)


def rebuilt_optimizer(
    params: AdamWParams, opt_state: Any, trainable_params: Any, shardings: Any, trainable: Any
) -> tuple[Any, Any, Any]:
    """``(tx, opt_state, apply_updates)`` of an AdamW chain with ``params``' constants around
    ``opt_state``'s moments (``transplanted_state``), the update compiled for the same shardings."""
    from backends.jax_pjit import steps
    from backends.jax_pjit.optim import build_optax

    optimizer = OptimizerConfig(name=ADAMW, kwargs=params.optimizer_kwargs())
    tx, _ = build_optax(optimizer, None, params.max_grad_norm)
    state = transplanted_state(tx, opt_state, trainable_params)
    opt_shardings = jax.tree.map(lambda x: x.sharding, state)
    return tx, state, steps.make_apply_updates(tx, shardings, opt_shardings, trainable)
