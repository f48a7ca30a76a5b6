"""Token log-probabilities from logits without materialising fp32 [B, S, V] whole.

``log_softmax(logits).gather(ids)`` allocates a full [B, S, V] float32 tensor (1 GB for
8 x 1024 x 32000), twice when the logits are bf16 and must be upcast first.  Here the
logits are viewed as [B*S, V] token rows and cut into chunks of rows: each chunk is
upcast, reduced to one log-probability per token, and freed.  The backward pass
recomputes each chunk's softmax instead of keeping it, so training has the same bound:
peak extra memory is one fp32 chunk plus the gradient itself (which has the logits'
shape and dtype by necessity).

Why rows of the flattened view and not slices of the sequence axis: a row range of a
contiguous [B*S, V] view is itself contiguous, while ``logits[:, s:e]`` is strided and
would be copied before every softmax (doubling the chunk's memory and time).  For the
same reason ``next_token_logprobs`` shifts the *targets* instead of slicing the logits.

On XLA (jax) the whole-array kernel is already what chunking achieves by hand: the
gather and the logsumexp fuse into one reduction that reads the logits once, and the
compiled program has no fp32 [B, S, V] temporary (0 bytes of temp buffers for fp32
logits by ``compiled.memory_analysis()``; tested).  Slicing into chunks instead makes XLA
copy the slices, so jax runs one pass unless a ``chunk_size`` is asked for.  (XLA:CPU
does upcast bf16 arrays whole, a CPU-backend limitation that chunking does not avoid.)

The per-chunk math (forward and gradient) is written once below; torch and jax only
differ in how a custom gradient is registered (``autograd.Function`` / ``custom_vjp``).
"""

from __future__ import annotations

import functools

from core.kernels.ops import ops_for

# Elements of one fp32 chunk ([rows, V]); 2**24 floats = 64 MiB.  A small fraction of the
# naive cost at realistic sizes, large enough that per-chunk overhead stays negligible.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def auto_chunk_size(tokens: int, vocab: int, budget: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Token rows per chunk so that one fp32 chunk holds about ``budget`` floats."""
    return max(1, min(tokens, budget // max(1, vocab)))


def chunk_bounds(rows: int, chunk_size: int):
    return [(s, min(s + chunk_size, rows)) for s in range(0, rows, chunk_size)]


def _chunk_logprobs(ops, logits_c, ids_c):
    """log p(ids) for one chunk: logits_c [c, V] -> [c] in the compute dtype."""
    return ops.log_softmax_at(ops.to_compute(logits_c), ids_c)


def _chunk_logprobs_grad(ops, logits_c, ids_c, g_c):
    """d(sum g * log p(ids)) / d logits for one chunk: g * (onehot(ids) - softmax)."""
    x = ops.to_compute(logits_c)
    g = ops.astype(g_c, x.dtype)
    grad = ops.softmax(x)  # the one chunk-sized temporary; reused in place below
    grad = ops.mul_(grad, -ops.expand_dims(g, -1))
    grad = ops.add_at_last_(grad, ids_c, g)
    return ops.astype(grad, logits_c.dtype)


def _forward_chunks(ops, flat, ids, chunk_size):
    parts = [_chunk_logprobs(ops, flat[s:e], ids[s:e]) for s, e in chunk_bounds(flat.shape[0], chunk_size)]
    return parts[0] if len(parts) == 1 else ops.concat(parts, axis=0)


# --------------------------------------------------------------------------- torch


@functools.cache
def _torch_function():
    import torch

    class ChunkedLogprobs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, flat, ids, chunk_size):
            ctx.save_for_backward(flat, ids)
            ctx.chunk_size = chunk_size
            return _forward_chunks(ops_for(flat), flat, ids, chunk_size)

        @staticmethod
        def backward(ctx, grad_out):
            flat, ids = ctx.saved_tensors
            ops = ops_for(flat)
            grad = torch.empty_like(flat)
            for s, e in chunk_bounds(flat.shape[0], ctx.chunk_size):
                grad[s:e] = _chunk_logprobs_grad(ops, flat[s:e], ids[s:e], grad_out[s:e])
            return grad, None, None

    return ChunkedLogprobs


# --------------------------------------------------------------------------- jax


@functools.cache
def _jax_function():
    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def chunked(flat, ids, chunk_size):
        return _forward_chunks(ops_for(flat), flat, ids, chunk_size)

    def fwd(flat, ids, chunk_size):
        return chunked(flat, ids, chunk_size), (flat, ids)

    def bwd(chunk_size, residuals, g):
        flat, ids = residuals
        ops = ops_for(flat)
        parts = [
            _chunk_logprobs_grad(ops, flat[s:e], ids[s:e], g[s:e]) for s, e in chunk_bounds(flat.shape[0], chunk_size)
        ]
        return (parts[0] if len(parts) == 1 else ops.concat(parts, axis=0)), None

    chunked.defvjp(fwd, bwd)
    return chunked


# --------------------------------------------------------------------------- public


def check_logits_and_ids(logits, ids) -> None:
    if len(logits.shape) != 3:
        raise ValueError(f"logits must be [B, S, V], got shape {tuple(logits.shape)}")
    if tuple(ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"target ids shape {tuple(ids.shape)} does not match logits [B, S] = {tuple(logits.shape[:2])}"
        )


def logprobs_from_logits(logits, target_ids, chunk_size: int | None = None):
    """log softmax(logits)[b, s, target_ids[b, s]] for every position.

    Args:
        logits: [B, S, V] float (any precision; bf16/fp16 are computed in fp32, fp64 stays
            fp64).  Pass contiguous logits: a strided view is copied once to flatten it.
        target_ids: [B, S] integer token ids in [0, V).
        chunk_size: token rows (of the [B*S, V] view) per chunk; ``None`` picks one so a
            chunk is ~64 MiB of fp32 on torch, and a single fused pass on jax.

    Returns:
        [B, S] log-probabilities in the compute dtype (fp32, or fp64 for fp64 logits),
        differentiable w.r.t. ``logits`` with the same memory bound in the backward pass.
    """
    check_logits_and_ids(logits, target_ids)
    ops = ops_for(logits)
    batch, seq, vocab = logits.shape
    tokens = batch * seq
    if tokens == 0:
        return ops.zeros((batch, seq), like=ops.to_compute(logits[..., 0]))
    if chunk_size is None:
        chunk_size = auto_chunk_size(tokens, vocab) if ops.name == "torch" else tokens
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat, ids = logits.reshape(tokens, vocab), target_ids.reshape(tokens)
    if ops.name == "torch":
        out = _torch_function().apply(flat, ids, int(chunk_size))
    else:
        out = _jax_function()(flat, ids, int(chunk_size))
    return out.reshape(batch, seq)


def next_token_logprobs(logits, input_ids, chunk_size: int | None = None):
    """log p(x_t | x_<t) for t = 1..S-1: logits [B, S, V], input_ids [B, S] -> [B, S-1].

    Position t of the result scores token ``input_ids[:, t + 1]`` with the logits emitted at
    position t, i.e. it lines up with per-token data sliced ``[:, 1:]``.
    """
    check_logits_and_ids(logits, input_ids)
    ops = ops_for(logits)
    # Shift the targets, not the logits (a logits slice is a strided copy of [B, S, V]).
    # The last position gets a dummy in-vocabulary target; its column is dropped, so it
    # receives a zero gradient.
    shifted = ops.concat([input_ids[:, 1:], input_ids[:, :1]], axis=1)
    return logprobs_from_logits(logits, shifted, chunk_size)[:, :-1]


def logprobs_to_sequence_layout(next_logprobs, input_lengths):
    """The ``get_logprobs`` layout: [B, S-1] next-token logprobs -> [B, S] float.

    Column 0 is 0 (the first token has no prediction), column i holds log p(x_i | x_<i),
    and every position at or past ``input_lengths[b]`` is 0.
    """
    ops = ops_for(next_logprobs)
    batch, seq_m1 = next_logprobs.shape
    first = ops.zeros((batch, 1), like=next_logprobs)
    full = ops.concat([first, next_logprobs], axis=1)
    positions = ops.expand_dims(ops.arange(seq_m1 + 1, like=next_logprobs), 0)
    valid = positions < ops.expand_dims(input_lengths, 1)
    return ops.where(valid, full, ops.zeros_like(full))


def apply_temperature(logits, temperature: float):
    """Divide logits by the sampling temperature.

    Used identically by ``get_logprobs`` and ``train`` in every backend so that the
    training logprobs are those of the distribution generation sampled from.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return logits if temperature == 1.0 else logits / temperature


def entropy_from_logits(logits, chunk_size: int | None = None):
    """Entropy of softmax(logits) per position: [B, S, V] -> [B, S] (compute dtype).

    Chunked over token rows like ``logprobs_from_logits``; gradients flow by autodiff
    (it is mostly a metric, so the backward is not specialised).
    """
    if len(logits.shape) != 3:
        raise ValueError(f"logits must be [B, S, V], got shape {tuple(logits.shape)}")
    ops = ops_for(logits)
    batch, seq, vocab = logits.shape
    flat = logits.reshape(batch * seq, vocab)
    if chunk_size is None:
        chunk_size = auto_chunk_size(batch * seq, vocab) if ops.name == "torch" else batch * seq
    parts = []
    for s, e in chunk_bounds(batch * seq, chunk_size):
        x = ops.to_compute(flat[s:e])
        parts.append(ops.logsumexp(x, axis=-1) - ops.sum(ops.softmax(x) * x, axis=-1))
    if not parts:
        return ops.zeros((batch, seq), like=ops.to_compute(logits[..., 0]))
    return ops.concat(parts, axis=0).reshape(batch, seq)
