"""Batch-invariant numerics (``policy.numerics: exact``): every reduction of a token's forward
runs on shapes fixed by the sequence alone.

Why a mode is needed.  A token's logits are the same function of its sequence in every
call only if every reduction on its path (a matmul's sum over ``K``, a norm's mean, a
softmax's sum, attention's sum over keys) adds the same numbers in the same order.  The
libraries do not promise that: MKL's fp32 GEMM and XLA's dot pick their blocking (and so
the order of the ``K`` sum) from the number of rows, XLA's row reductions and its
vectorised ``exp`` change with the array's shape, torch's fp32 ``sigmoid`` takes a scalar
path for the tail of a tensor, and attention kernels split the keys by the query length
(a one-token decode step and a full training forward reduce differently).  So the
sampler's logprob of a token and the trainer's differ in the last bits, by batch
composition, micro batch size, padding and KV-cache decoding.

What the mode fixes.  Each engine computes, on its own kernels, with these shapes only:

* **Row tiles.**  Every per-token computation (linear layers, norms, activations, the LM
  head, the logprob kernel) runs on tiles of ``ROW_TILE`` token rows (the rows padded up
  to a multiple; the padding rows are dropped).  A kernel called on a fixed shape runs the
  same code for every call, and within a tile each row is reduced on its own, so a row's
  result depends on the row alone, not on its neighbours, its position or the row count.
* **Attention in key blocks.**  The queries of one (row, kv head) are cut into tiles of
  ``QUERY_TILE``; the keys, held at their absolute positions (the cache column of a key is
  its position, in the training forward and in KV-cache decoding alike), into blocks of
  ``KEY_BLOCK``, visited in order 0, 1, 2, ... with an online softmax
  (:func:`online_softmax_update`).  A block holding no key a query may read (positions past
  the query's) leaves the running max, sum and output unchanged bit for bit (its scale is
  ``exp(0) = 1`` and its terms exact zeros), so a decode step over a cache of any length
  and a training forward over a padded width give a query the same bits.
* **Row-wise reductions** (a norm's mean, the softmax of the logprob kernel) run on the
  row tiles above: the reduced length is the row's own (hidden size, vocabulary).

The engines supply the fixed-shape batched matmul and the iteration (torch: ``bmm`` over
tiles; JAX: a loop over tiles, in the JAX backend's exact model layers); the arithmetic of
an attention block is written once here.  Nothing here makes results equal *across*
engines or across precisions: each engine is exact against itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from core.kernels.ops import ops_for

#: Token rows per tile of every per-token computation.
ROW_TILE = 64
#: Query rows per attention tile (the query heads of one kv head, position-major).
QUERY_TILE = 8
#: Keys per attention block.
KEY_BLOCK = 64

#: ``matmul(a [..., M, K], b [..., K, N]) -> [..., M, N]``: a batched matmul whose every
#: matrix has the same (M, K, N), so each product is the same kernel call.
FixedMatmul = Callable[[Any, Any], Any]


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(1, -(-n // multiple)) * multiple


class SoftmaxCarry(NamedTuple):
    """Online-softmax state of a tile of queries after some key blocks."""

    running_max: Any  # [..., QT, 1] float32
    denominator: Any  # [..., QT, 1] float32
    numerator: Any  # [..., QT, D] float32: sum of exp(score - running_max) * value


def block_scores(queries, keys_t, query_positions, first_key: int | Any, scale: float, matmul: FixedMatmul):
    """Scaled scores of a tile of queries against one key block, masked causally.

    Args:
        queries: [..., QT, D] float32.
        keys_t: [..., D, KB] float32 (the block's keys, transposed).
        query_positions: [..., QT] int, each query's position.
        first_key: position of the block's first key (its keys are ``first_key + 0..KB-1``).
        scale: the attention scale (``head_dim ** -0.5`` for these models).
        matmul: the engine's fixed-shape batched matmul.

    Returns:
        [..., QT, KB] float32: ``q . k * scale`` where key position <= query position, else -inf.
    """
    ops = ops_for(queries)
    block = keys_t.shape[-1]
    key_positions = ops.arange(block, like=query_positions) + first_key  # (KB,)
    allowed = key_positions <= ops.expand_dims(query_positions, -1)  # (..., QT, KB)
    scores = matmul(queries, keys_t) * scale
    return ops.where(allowed, scores, ops.zeros_like(scores) - float("inf"))


def online_softmax_init(queries) -> SoftmaxCarry:
    """The state before the first block: max -inf, sums 0 (shapes from ``queries`` [..., QT, D])."""
    ops = ops_for(queries)
    column = ops.zeros_like(queries[..., :1])
    return SoftmaxCarry(column - float("inf"), column, ops.zeros_like(queries))


def online_softmax_update(carry: SoftmaxCarry, scores, values, matmul: FixedMatmul) -> SoftmaxCarry:
    """Fold one key block into the state: scores [..., QT, KB], values [..., KB, D] (float32).

    Block 0 always holds key 0, which every query may read, so the running max is finite
    from the first block on; a later block with no readable key has max -inf, leaves the
    running max as it is (rescale ``exp(0) = 1``) and adds exact zeros.
    """
    ops = ops_for(scores)
    block_max = ops.amax(scores, axis=-1, keepdims=True)
    new_max = ops.maximum(carry.running_max, block_max)
    rescale = ops.exp(carry.running_max - new_max)
    weights = ops.exp(scores - new_max)
    denominator = carry.denominator * rescale + ops.sum(weights, axis=-1, keepdims=True)
    numerator = carry.numerator * rescale + matmul(weights, values)
    return SoftmaxCarry(new_max, denominator, numerator)


def online_softmax_result(carry: SoftmaxCarry):
    """Attention output [..., QT, D] float32 of the folded blocks."""
    return carry.numerator / carry.denominator
