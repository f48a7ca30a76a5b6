"""Jitted logprob and train steps of the JAX backend, with shape bucketing.

The steps are pure functions of ``(params, batch)``; the model enters as
``apply_fn(params, input_ids, attention_mask, positions) -> logits [B, S, V]``.  The loss
is one of the shared ``core.losses`` objects, called on jax arrays through its
``loss_from_logprobs`` (the same logprob path as ``get_logprobs``: temperature, then
``core.kernels.next_token_logprobs``).

Why buckets: ``jit`` compiles one program per input shape.  Every micro batch is padded
to ``micro_batch_size`` rows (padding rows have ``sample_mask = 0``, so they contribute
nothing) and to a sequence length from a short ladder (powers of two from 16, capped at
``max_total_sequence_length``), so a run compiles at most ``len(ladder)`` programs per step
kind, however ragged its batches are.  ``CompileCounter`` reports how many were built.

Gradient accumulation uses the same global normalisation as the torch backends: the
loss of every micro batch is divided by the *global* number of valid tokens (or
sequences) of the step's batch, so the accumulated gradient is the full-batch gradient,
independent of the micro-batch size.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from core.kernels import apply_temperature, logprobs_to_sequence_layout, next_token_logprobs

ApplyFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]
MIN_BUCKET = 16


def length_buckets(max_len: int, minimum: int = MIN_BUCKET) -> list[int]:
    """Powers of two from ``minimum`` up to, and always ending at, ``max_len``."""
    ladder, n = [], minimum
    while n < max_len:
        ladder.append(n)
        n *= 2
    return ladder + [max_len]


def bucket_for(length: int, max_len: int) -> int:
    """The smallest bucket holding ``length`` tokens."""
    if length > max_len:
        raise ValueError(f"sequence length {length} exceeds policy.max_total_sequence_length={max_len}")
    return next(b for b in length_buckets(max_len) if b >= length)


def pad_micro_batch(batch: Mapping[str, np.ndarray], rows: int, width: int) -> dict[str, np.ndarray]:
    """Pad every per-row array to ``rows`` rows and every per-token array to ``width``
    columns (zeros; masks therefore exclude the padding).  Inputs are host numpy arrays."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        pad = [(0, rows - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
        if value.ndim >= 2:
            pad[1] = (0, width - value.shape[1])
        out[key] = np.pad(value, pad)
    return out


def positions_and_mask(input_lengths: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """``attention_mask`` [B, S] (1 on valid tokens) and ``positions`` [B, S] (0, 1, ...)."""
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (input_lengths.shape[0], width))
    return pos, (pos < input_lengths[:, None]).astype(jnp.int32)


def make_logprob_step(apply_fn: ApplyFn, temperature: float) -> Callable:
    """``(params, input_ids [B,S], input_lengths [B]) -> logprobs [B,S] float32`` in the
    ``get_logprobs`` layout."""

    @jax.jit
    def step(params, input_ids, input_lengths):
        positions, mask = positions_and_mask(input_lengths, input_ids.shape[1])
        logits = apply_temperature(apply_fn(params, input_ids, mask, positions), temperature)
        next_lp = next_token_logprobs(logits, input_ids)
        return logprobs_to_sequence_layout(next_lp, input_lengths).astype(jnp.float32)

    return step


def zero_grads(params: Any) -> Any:
    """A gradient accumulator: zeros shaped *and sharded* like ``params``.

    The sharding must be the one the grad step returns, or the second micro batch would see
    a differently laid-out accumulator and compile a second program.
    """
    # jnp.zeros(device=...) hits jax's own compilation cache on every call; a fresh
    # jax.jit(lambda ...) per call would trace and compile again each time.
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), params)


def make_grad_step(apply_fn: ApplyFn, loss_fn: Any, temperature: float, grad_shardings: Any = None) -> Callable:
    """``(params, grads_acc, batch, global_valid_seqs, global_valid_toks) ->
    (grads_acc + d loss/d params, metrics)`` for one micro batch.

    ``grads_acc`` is donated: the accumulator is updated in place on the devices, and kept
    in ``grad_shardings`` (the params' shardings) so every call reuses one program.
    """

    def micro_loss(params, batch, gseq, gtok):
        positions, mask = positions_and_mask(batch["input_lengths"], batch["input_ids"].shape[1])
        logits = apply_temperature(apply_fn(params, batch["input_ids"], mask, positions), temperature)
        next_lp = next_token_logprobs(logits, batch["input_ids"])
        return loss_fn.loss_from_logprobs(next_lp, batch, gseq, gtok)

    out_shardings = None if grad_shardings is None else (grad_shardings, None)

    @functools.partial(jax.jit, donate_argnums=(1,), out_shardings=out_shardings)
    def step(params, grads_acc, batch, gseq, gtok):
        (_, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, batch, gseq, gtok)
        return jax.tree.map(jnp.add, grads_acc, grads), metrics

    return step


def make_apply_updates(tx, param_shardings: Any = None, opt_shardings: Any = None) -> Callable:
    """``(params, opt_state, grads) -> (params, opt_state, grad_norm)``; params and optimizer
    state are donated (updated in place) and kept in their shardings, so the steps that
    consume them next see the same layout and reuse their programs."""
    import optax

    out = None if param_shardings is None else (param_shardings, opt_shardings, None)

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out)
    def apply(params, opt_state, grads):
        norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    return apply


def global_valid_counts(sample_mask: np.ndarray, token_mask: np.ndarray | None,
                        input_lengths: np.ndarray) -> tuple[np.float32, np.float32]:
    """Valid sequences and next-token positions of a whole (global) batch, on the host.

    Computed before the micro-batch loop from the full step batch, exactly what the torch
    backends all-reduce over their data-parallel ranks.
    """
    sample_mask = np.asarray(sample_mask, np.float64)
    if token_mask is not None:
        tokens = (np.asarray(token_mask, np.float64)[:, 1:] * sample_mask[:, None]).sum()
    else:
        tokens = ((np.asarray(input_lengths) - 1).clip(0) * sample_mask).sum()
    return np.float32(sample_mask.sum()), np.float32(tokens)


class CompileCounter:
    """How many programs the jitted steps compiled (``jax.jit``'s own cache sizes)."""

    def __init__(self, **steps: Callable) -> None:
        self.steps = steps

    def counts(self) -> dict[str, int]:
        return {name: fn._cache_size() for name, fn in self.steps.items()}
