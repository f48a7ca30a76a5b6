"""The jitted steps of the JAX backend in exact mode (``policy.numerics: exact``): the logprob
step and the gradient step on the exact forward (``models.exact``).

Both compute a token's logprob with the same tile functions on the same shapes as the exact
sampler (``exact_generate``), so ``get_logprobs``, the training forward (whose detached
logprobs are the old policy's when a rollout gets one optimizer step) and the sampler agree
bit for bit.  Contracts as ``steps.make_logprob_step`` / ``steps.make_grad_step``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from backends.jax_pjit.models.exact import exact_next_logprobs
from backends.jax_pjit.steps import value_and_grad_of
from core.interfaces import LossFunction
from core.kernels.logprobs import logprobs_to_sequence_layout

__all__ = ["make_exact_grad_step", "make_exact_logprob_step"]


def make_exact_logprob_step(model, temperature: float, mesh: Mesh | None = None) -> Callable:
    """``(params, input_ids [B, S], input_lengths [B]) -> logprobs [B, S] float32`` in the
    ``get_logprobs`` layout."""
    next_logprobs, _ = exact_next_logprobs(model, mesh)

    @jax.jit
    def run(params, temperature, input_ids, input_lengths):
        lp = next_logprobs(params, input_ids, temperature)
        return logprobs_to_sequence_layout(lp, input_lengths).astype(jnp.float32)

    return _WithTemperature(run, jnp.float32(temperature))


class _WithTemperature:
    """A jitted step called with its temperature as an argument (so the program divides by a
    traced value, as the sampler's does); ``_cache_size`` is the jitted function's."""

    def __init__(self, run: Any, temperature: jax.Array) -> None:
        self.run, self.temperature = run, temperature

    def __call__(self, params, *args):
        return self.run(params, self.temperature, *args)

    def _cache_size(self) -> int:
        return self.run._cache_size()


def make_exact_grad_step(
    model,
    loss_fn: LossFunction,
    temperature: float,
    mesh: Mesh | None = None,
    grad_shardings: Any = None,
) -> Callable:
    """``(params, grads_acc, batch, global_valid_seqs, global_valid_toks) ->
    (grads_acc + d loss/d params, metrics)`` for one micro batch; ``grads_acc`` donated and
    kept in ``grad_shardings``.  The forward is always recomputed in the backward pass
    (``exact_next_logprobs``), as ``jax_cfg.activation_checkpointing`` would do.  (No LoRA,
    routing or router loss: refused in exact mode.)"""
    next_logprobs, _ = exact_next_logprobs(model, mesh)

    def micro_loss(params, batch, gseq, gtok, temperature):
        ids = batch["input_ids"]
        next_lp = next_logprobs(params, ids, temperature, differentiable=True)
        return loss_fn.loss_from_logprobs(next_lp, batch, gseq, gtok)

    grad_fn = value_and_grad_of(micro_loss)
    out_shardings = None if grad_shardings is None else (grad_shardings, None)

    @functools.partial(jax.jit, donate_argnums=(1,), out_shardings=out_shardings)
    def run(params, grads_acc, batch, gseq, gtok, temperature):
        (_, metrics), grads = grad_fn(params, batch, gseq, gtok, temperature)
        return jax.tree.map(jnp.add, grads_acc, grads), metrics

    return _WithTemperature(_LastArgument(run), jnp.float32(temperature))


class _LastArgument:
    """``run(params, *args, temperature)`` called as ``(params, temperature, *args)``."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def __call__(self, params, temperature, *args):
        return self.run(params, *args, temperature)

    def _cache_size(self) -> int:
        return self.run._cache_size()
