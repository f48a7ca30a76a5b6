"""Token log-probabilities from vocabulary-sharded logits (tensor-parallel lm_head).

With tensor parallelism the lm_head is column-parallel: rank r of the tp group holds the
logits of the vocabulary slice [r * V/tp, (r + 1) * V/tp).  Gathering the slices to call
``logprobs_from_logits`` would move and store the full [B, S, V] tensor on every rank.
Instead each rank reduces its slice to per-token vectors and only those are combined:

    m    = max_v x_v                               all_reduce(MAX)
    Z    = sum_v exp(x_v - m)                      \\
    x_t  = the target's logit (0 off its shard)     |  one all_reduce(SUM) of a
    hits = 1 on the shard holding the target        /  stacked [3, N] tensor
    log p(t) = x_t - (m + log Z)

so the communication is O(B * S) per call, independent of V.  As in
``core.kernels.logprobs`` the local [N, V_local] rows are processed in chunks: a bf16
input is upcast one chunk at a time, and the backward recomputes each chunk's softmax
instead of saving it.

This module is torch-only (``torch.distributed`` process groups and DTensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.kernels.logprobs import auto_chunk_size, check_logits_and_ids, chunk_bounds, logprobs_from_logits


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; every other float dtype is computed in fp32 (as ``ops.to_compute``)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _local_targets(ids: torch.Tensor, vocab_start: int, vocab_end: int):
    """ids [N] global -> (in_shard [N] bool, idx [N] long local column; 0 off the shard)."""
    in_shard = (ids >= vocab_start) & (ids < vocab_end)
    idx = torch.where(in_shard, ids - vocab_start, torch.zeros_like(ids)).long()
    return in_shard, idx


def _exp_shifted(chunk: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(chunk - shift[:, None]) in the compute dtype: [c, V_local], [c] -> [c, V_local].

    ``shift`` is already in the compute dtype, so type promotion upcasts a bf16 chunk inside
    the subtraction: the result is the only chunk-sized temporary, exponentiated in place.
    """
    return torch.sub(chunk, shift[:, None]).exp_()


def _forward(flat, ids, vocab_start, vocab_end, group, chunk_size):
    """Local logits [N, V_local], ids [N] -> (logprobs [N], logsumexp [N]), compute dtype."""
    dtype = _compute_dtype(flat)
    rows = flat.shape[0]

    # The max is exact in every float dtype, so it is taken before the upcast ([N] only).
    row_max = flat.amax(dim=-1).to(dtype)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # Like torch.logsumexp: an infinite max would make x - max NaN for every entry.
    row_max = row_max.masked_fill(row_max.abs() == float("inf"), 0.0)

    stats = torch.zeros(3, rows, dtype=dtype, device=flat.device)
    for s, e in chunk_bounds(rows, chunk_size):
        stats[0, s:e] = _exp_shifted(flat[s:e], row_max[s:e]).sum(dim=-1)
    in_shard, idx = _local_targets(ids, vocab_start, vocab_end)
    target_logit = flat.gather(1, idx[:, None]).squeeze(1).to(dtype)
    stats[1] = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
    stats[2] = in_shard.to(dtype)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

    logsumexp = row_max + torch.log(stats[0])
    logprobs = stats[1] - logsumexp
    # A target outside [0, V) is held by no rank (hits == 0); the unsharded kernel raises
    # an index error there.  Make it loud with NaN rather than silently scoring x_t = 0.
    logprobs = torch.where(stats[2] == 1, logprobs, torch.full_like(logprobs, float("nan")))
    return logprobs, logsumexp


def _backward(flat, ids, logsumexp, grad_out, vocab_start, vocab_end, chunk_size):
    """d(sum g * log p(t)) / d local logits = g * (onehot_local(t) - softmax_local).

    No communication: softmax_v = exp(x_v - logsumexp) needs only this rank's own logits
    and the global logsumexp (already all-reduced in the forward and saved), and the one-hot
    term is nonzero only on the rank that holds the target.  The upstream gradient g is the
    same on every tp rank, since each computes the same loss from the same (all-reduced)
    logprobs, so each rank's slice of the full gradient is computed locally.
    """
    grad = torch.empty_like(flat)
    g = grad_out.to(logsumexp.dtype)
    in_shard, idx = _local_targets(ids, vocab_start, vocab_end)
    g_target = torch.where(in_shard, g, torch.zeros_like(g))  # off the shard: adds 0 at col 0
    for s, e in chunk_bounds(flat.shape[0], chunk_size):
        chunk_grad = _exp_shifted(flat[s:e], logsumexp[s:e])  # softmax rows, this shard
        chunk_grad.mul_(-g[s:e, None])
        chunk_grad.scatter_add_(1, idx[s:e, None], g_target[s:e, None])
        grad[s:e] = chunk_grad  # the copy casts back to the input dtype
    return grad


class VocabParallelLogprobs(torch.autograd.Function):
    """log p(target) from this rank's vocabulary slice of the logits.

    forward(local_logits [N, V_local] float, target_ids [N] int (global ids), vocab_start,
    vocab_end, group, chunk_size=None) -> [N] in the compute dtype (fp32, fp64 for fp64).
    Every rank of ``group`` must call it with the same ``target_ids`` and its own slice
    [vocab_start, vocab_end); the result is the same on every rank.  The backward returns
    the gradient of the local slice, in the input's dtype, without communication.
    """

    @staticmethod
    def forward(ctx, local_logits, target_ids, vocab_start, vocab_end, group, chunk_size=None):
        if chunk_size is None:
            chunk_size = auto_chunk_size(local_logits.shape[0], local_logits.shape[1])
        logprobs, logsumexp = _forward(local_logits, target_ids, vocab_start, vocab_end, group, chunk_size)
        ctx.save_for_backward(local_logits, target_ids, logsumexp)
        ctx.vocab_range = (vocab_start, vocab_end)
        ctx.chunk_size = chunk_size
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):
        local_logits, target_ids, logsumexp = ctx.saved_tensors
        grad = _backward(local_logits, target_ids, logsumexp, grad_out, *ctx.vocab_range, ctx.chunk_size)
        return grad, None, None, None, None, None


# --------------------------------------------------------------------------- public


def _is_dtensor(x) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _plain(ids):
    """Target ids as a plain tensor (a DTensor's ids are replicated: take the full value)."""
    return ids.full_tensor() if _is_dtensor(ids) else ids


def _dtensor_vocab_shard(logits):
    """A [B, S, V] DTensor -> (local [B, S, V/tp], group, vocab_start, vocab_end), or None
    when it is replicated.  Only a 1-D mesh with a Shard(2) placement is a vocab shard."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"logits DTensor is on a {mesh.ndim}-D mesh {tuple(mesh.shape)} with placements "
            f"{tuple(logits.placements)}; pass it on the 1-D tensor-parallel mesh, e.g. "
            "DTensor.from_local(logits.to_local(), mesh['tp'], [Shard(2)])"
        )
    placement = logits.placements[0]
    if isinstance(placement, Replicate):
        return None
    if not (isinstance(placement, Shard) and placement.dim % 3 == 2):
        raise ValueError(f"logits DTensor must be Shard(2) (vocab) or Replicate, got placement {placement}")
    tp, vocab = mesh.size(), logits.shape[-1]
    if vocab % tp:
        raise ValueError(f"vocab size {vocab} is not divisible by the mesh size {tp}: shards must be equal")
    local = logits.to_local()
    v_local = vocab // tp
    if local.shape[-1] != v_local:
        raise ValueError(f"local logits shape {tuple(local.shape)} is not an equal 1/{tp} vocab shard of V={vocab}")
    rank = mesh.get_local_rank()
    return local, mesh.get_group(), rank * v_local, (rank + 1) * v_local


def vocab_parallel_logprobs(
    logits, target_ids, group=None, vocab_start=None, vocab_end=None, *, chunk_size: int | None = None
):
    """log softmax(logits)[b, s, target_ids[b, s]] with the vocabulary sharded over ``group``.

    Args:
        logits: either a DTensor [B, S, V] on a 1-D mesh, placed Shard(2) (e.g. the output
            of a ColwiseParallel lm_head with ``use_local_output=False``; group and vocab
            range come from the mesh) or Replicate (computed unsharded); or this rank's plain
            slice [B, S, V_local] of the logits, with ``vocab_start``/``vocab_end`` (its
            columns' global ids, ``vocab_end - vocab_start == V_local``) and ``group``
            (``None``: the default process group).  Any float dtype.
        target_ids: [B, S] global token ids in [0, V), the same on every rank (a replicated
            DTensor is accepted).  Ids outside [0, V) give NaN.
        chunk_size: token rows per chunk; ``None`` picks ~64 MiB of fp32 per chunk.

    Returns:
        [B, S] plain tensor of log-probabilities in the compute dtype (fp32, or fp64 for
        fp64 logits), identical on every rank, differentiable w.r.t. ``logits``.
    """
    check_logits_and_ids(logits, target_ids)
    ids = _plain(target_ids)
    if _is_dtensor(logits):
        if group is not None or vocab_start is not None or vocab_end is not None:
            raise ValueError("group / vocab_start / vocab_end are taken from the DTensor's mesh; do not pass them")
        shard = _dtensor_vocab_shard(logits)
        if shard is None:
            return logprobs_from_logits(logits.full_tensor(), ids, chunk_size)
        # to_local() is differentiable: the local gradient comes back as a Shard(2) DTensor grad.
        local, group, vocab_start, vocab_end = shard
    else:
        if vocab_start is None or vocab_end is None:
            raise ValueError("plain-tensor logits need vocab_start and vocab_end (the slice's global ids)")
        if vocab_end - vocab_start != logits.shape[-1]:
            raise ValueError(
                f"vocab range [{vocab_start}, {vocab_end}) has {vocab_end - vocab_start} ids but the local "
                f"logits shape {tuple(logits.shape)} has {logits.shape[-1]} columns"
            )
        local = logits
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, seq, v_local = local.shape
    flat = local.reshape(batch * seq, v_local)
    out = VocabParallelLogprobs.apply(
        flat, ids.reshape(batch * seq), int(vocab_start), int(vocab_end), group, chunk_size
    )
    return out.reshape(batch, seq)


def vocab_parallel_next_token_logprobs(
    logits, input_ids, group=None, vocab_start=None, vocab_end=None, *, chunk_size: int | None = None
):
    """log p(x_t | x_<t) for t = 1..S-1 from vocab-sharded logits: -> [B, S-1].

    Mirrors ``next_token_logprobs``: the targets are shifted (not the logits, whose slice
    would be a strided copy); the last position's dummy target is dropped with its column.
    Arguments as ``vocab_parallel_logprobs``.
    """
    check_logits_and_ids(logits, input_ids)
    ids = _plain(input_ids)
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    out = vocab_parallel_logprobs(logits, shifted, group, vocab_start, vocab_end, chunk_size=chunk_size)
    return out[:, :-1]
