"""Which compiled gradient step a JAX worker trains with: the exact forward (``policy.numerics:
exact``), plain right-padded rows, or the explicit row layouts (context parallelism, packing)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from backends.jax_pjit import steps
from backends.jax_pjit.exact_steps import make_exact_grad_step
from backends.jax_pjit.row_layouts import RowLayouts


def make_worker_grad_step(
    loss_fn: Any,
    *,
    exact_model: Any | None,
    apply_fn: Callable,
    remat: bool,
    rows: RowLayouts,
    temperature: float,
    grad_shardings: Any,
    trainable: Any,
    router_aux: Any,
    replay: bool,
) -> Callable:
    """The grad step for ``loss_fn`` (``exact_model``: the worker's model in exact mode, else None).
    Only the grad steps remat: a forward-only step has no backward to save memory for."""
    if exact_model is not None:
        return make_exact_grad_step(exact_model, loss_fn, temperature, rows.mesh, grad_shardings)
    fn = functools.partial(apply_fn, remat=True) if remat else apply_fn
    if rows.plain:
        return steps.make_grad_step(fn, loss_fn, temperature, grad_shardings, trainable, router_aux, replay=replay)
    return steps.make_layout_grad_step(fn, loss_fn, temperature, rows.cp, grad_shardings, trainable, router_aux)
