"""Context parallelism for the DTensor backend: the sequence split over the ``cp`` mesh axis.

Each cp rank runs the model on its load-balanced share of every row's columns (a head
chunk and a tail chunk, ``core.data.context_parallel``) with the RoPE positions of those
columns.  Two ways to attend over the whole sequence:

* **all-gather (every device, gloo included)** -- the attention function registered here
  as ``"dualrl_cp_allgather"`` all-gathers each layer's keys and values over the cp group
  (Llama 3's long-context training) and runs SDPA against an explicit mask built from
  column order and segments, so ragged rows and packed rows are both exact.  The gather's
  backward sums the key/value gradients of all ranks' queries and keeps this rank's slice.
* **torch's ring attention (CUDA)** -- :func:`create_context_parallel_ctx` /
  :func:`train_context` wrap ``torch.distributed.tensor.experimental.context_parallel``
  with the seed's signatures, for callers that shard their own buffers.  It only patches
  SDPA's CUDA kernels and supports no attention mask, so the worker uses the all-gather
  path on every device and this pair is the seed's API for users who want ring attention.

Per-token logprobs are computed locally (target = the token after each local column) and
all-gathered back into the row; every cp rank then evaluates the same loss, so that
gather's backward keeps only this rank's slice.  FSDP2 shards over the flattened
``(dp, cp)`` mesh, so its gradient reduction also sums the cp ranks' partial gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from backends.torch_common.batches import to_device
from backends.torch_common.torch_private import set_ring_attention_rotate_method
from core.data.context_parallel import attention_allowed, load_balanced_columns

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_NAME = "dualrl_cp_allgather"
_cp_group: dist.ProcessGroup | None = None


class _GatherSeq(torch.autograd.Function):
    """All-gather ``x`` over ``group`` along ``dim`` (rank order).

    Backward: ``sum_grads`` -- the gathered tensor fed rank-specific computations (keys and
    values read by each rank's own queries): the gradient of this rank's slice is the sum
    over ranks; otherwise every rank computed the same function of the gathered tensor and
    the gradient of this rank's slice is its own copy of it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup, sum_grads: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.sum_grads:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        mine = grad.chunk(dist.get_world_size(ctx.group), ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None, None


def gather_seq(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sum_grads: bool) -> torch.Tensor:
    return _GatherSeq.apply(x, dim, group, sum_grads)


def _allgather_attention(module, query, key, value, attention_mask, **kwargs):
    """HF attention-interface function: local queries against the whole row's keys/values."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _cp_group is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} used outside a context-parallel worker")
    key = gather_seq(key, 2, _cp_group, sum_grads=True)  # [b, kv_heads, T, d]
    value = gather_seq(value, 2, _cp_group, sum_grads=True)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def install_allgather_attention(model: PreTrainedModel, group: dist.ProcessGroup) -> None:
    """Route ``model``'s attention through the all-gather function over ``group``."""
    from transformers import AttentionInterface

    global _cp_group
    _cp_group = group
    AttentionInterface.register(ATTENTION_NAME, _allgather_attention)
    model.set_attn_implementation(ATTENTION_NAME)


class ContextParallelRows:
    """One rank's view of context-parallel rows: which columns it runs, the mask, and the
    reassembly of per-token logprobs."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def next_logprobs(
        self,
        forward: Callable[..., torch.Tensor],
        token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        ids: torch.Tensor,
        positions: torch.Tensor,
        segments: np.ndarray,
        prefix_segments: np.ndarray | None = None,
    ) -> torch.Tensor:
        """``[rows, T - 1]`` next-token logprobs of ``ids`` [rows, T], equal to the cp=1 ones
        (``segments`` / ``prefix_segments``: ``core.data.context_parallel.attention_allowed``).

        ``forward(input_ids, position_ids, attention_mask) -> logits`` runs the model (with
        temperature) on this rank's columns; ``token_logprobs(logits, targets)`` scores them.
        """
        width = ids.shape[1]
        cols = load_balanced_columns(width, self.cp)
        mine, order = cols[self.rank], cols.reshape(-1)
        # Host-built index/mask tensors go over with to_device: no host sync per micro batch.
        mask = attention_allowed(mine, order, segments, prefix_segments)
        allowed = to_device(torch.from_numpy(mask)[:, None], ids.device)
        index = to_device(torch.from_numpy(mine), ids.device)
        logits = forward(ids[:, index], positions[:, index], allowed)
        targets = ids[:, to_device(torch.from_numpy(np.minimum(mine + 1, width - 1)), ids.device)]
        local = token_logprobs(logits, targets)  # [rows, T / cp]
        return self.gather_columns(local, width, dim=1)[:, : width - 1]

    def gather_columns(self, local: torch.Tensor, width: int, dim: int) -> torch.Tensor:
        """This rank's columns of a per-token tensor (``dim``: its T / cp columns, as the
        forward ran them) -> all T columns in row order, on every cp rank.  Every rank then
        computes the same function of it, so the gather's backward keeps this rank's slice."""
        order = load_balanced_columns(width, self.cp).reshape(-1)
        row = gather_seq(local, dim, self.group, sum_grads=False)  # columns in `order`
        return row.index_select(dim, to_device(torch.from_numpy(np.argsort(order)), local.device))


# ------------------------------------------------------------------ the seed's API
def create_context_parallel_ctx(
    cp_mesh: Any,
    cp_buffers: Sequence[torch.Tensor],
    cp_seq_dims: Sequence[int],
    cp_no_restore_buffers: set[torch.Tensor],
    cp_rotate_method: str | None = None,
):
    """torch's ring-attention context (NeMo RL's ``DTensorPolicyWorker`` signature): shards
    ``cp_buffers`` along ``cp_seq_dims`` over ``cp_mesh`` for the duration of the context
    and restores them after, except ``cp_no_restore_buffers``.  CUDA SDPA only."""
    from torch.distributed.tensor.experimental import context_parallel

    if cp_rotate_method is not None:
        set_ring_attention_rotate_method(cp_rotate_method)
    return context_parallel(
        cp_mesh, buffers=list(cp_buffers), buffer_seq_dims=list(cp_seq_dims), no_restore_buffers=cp_no_restore_buffers
    )


@contextlib.contextmanager
def train_context(cp_context: Any = None) -> Iterator[None]:
    """Enter ``cp_context`` (from :func:`create_context_parallel_ctx`) with SDPA limited to
    the kernels ring attention implements; a no-op without one."""
    with contextlib.ExitStack() as stack:
        if cp_context is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]))
            stack.enter_context(cp_context)
        yield
