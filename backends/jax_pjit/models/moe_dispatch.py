"""Expert dispatch for a top-k mixture of SwiGLU experts: dense, grouped and blocked.

All three compute, for tokens x [T, E], the experts ``index`` [T, K] each token was routed to
and their routing weights ``weight`` [T, K], with stacked kernels gate / up [X, E, M] and
down [X, M, E]:

    out[t] = sum_k weight[t, k] * down_j(silu(gate_j(x[t])) * up_j(x[t])),   j = index[t, k]

The weight multiplies before the (linear) down projection, as in HF's per-expert loop up to
rounding.  Shapes are static whatever the routing (no capacity, no dropped tokens), so each
jits, differentiates and runs under ``jax.sharding`` like any other op.

* ``dense_experts`` runs every expert on every token, the K weights scattered into a [T, X]
  matrix that is 0 for the experts a token was not routed to.  Plain einsums, expert-parallel
  under sharding (a [T, E] all-reduce), but 6 * T * X * E * M forward FLOPs -- X / K times the
  routed work -- and a [T, X, M] activation.
* ``grouped_experts`` sorts the T * K (token, slot) pairs by expert, so each expert's rows are
  contiguous, and runs ``jax.lax.ragged_dot`` on them: 6 * T * K * E * M FLOPs *where
  ragged_dot has a grouped kernel* (TPU).  Elsewhere -- CPU, and GPU in jax 0.11.2 (seen on an
  H100) -- ragged_dot lowers to its reference expansion: the rows masked into a [T * K, X * E]
  copy ([T * K, X * M] for down) and one dense dot, K times the FLOPs of ``dense_experts``.
* ``blocked_experts`` does the grouping itself: the expert-sorted rows are padded so that every
  expert starts a new block of ``block`` rows (at most T * K + X * (block - 1) rows, a static
  bound), and a ``lax.scan`` over the blocks runs each through its expert's kernels with plain
  dots: about 6 * (T * K + X * block) * E * M FLOPs on any backend.  Its dynamic index into the
  kernels all-gathers expert-sharded kernels (as FSDP does): it is not expert-parallel.
* ``expert_parallel_experts`` is expert parallelism, one rank's part inside a ``shard_map``
  over the axis the experts are stored on: every rank's tokens gathered, this rank's experts
  run blocked on the pairs routed to them (the rest dropped, the empty blocks skipped), the
  partial outputs reduce-scattered back (Megatron's all-gather token dispatcher): the kernels
  never move, and a rank's expert FLOPs are about 1 / ranks of the layer's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

#: How the model's "blocked" runs on each platform (``benchmarks.moe_dispatch``, forward +
#: backward of one layer, ratios side by side), all exact:
#:
#: * ``block``: rows per block.  CPU 128 (64 was as fast forward + backward and slower forward).
#:   GPU 1024: on one H100 (bf16, the Qwen3-30B-A3B layer: 128 experts, top 8, 2048 x 768)
#:   blocks of 1024 trained faster than blocks of 512 and 256; each block costs a launch.
#: * ``margin``: blocked runs once ``tokens * (X - K) > margin * X * block`` (dense pushes T * X
#:   rows through the experts, blocked at most T * K + X * block).  CPU 1 (the row count alone:
#:   171 tokens for 8 experts top 2).  GPU 4: dense's big matmuls run near peak and kept
#:   the lead at 4,096 tokens of that layer; blocked 1024 led from 8,192 tokens.
#: * ``min_dense_flops``: and only when dense's forward FLOPs (6 T X E M) reach this: a layer too
#:   small to fill the GPU is launch-bound either way, and dense has the fewest launches (the
#:   8-expert 512 x 704 bench layer, 2.8e11 FLOPs at 16,384 tokens, runs faster dense).
#:
#: The numbers behind each rule: docs/results.md#kernels-attention-and-moe-dispatch.
#: Other platforms (TPU) are not measured: ``auto`` leaves them dense (``resolve_dispatch``).
BLOCKED_RULES: dict[str, dict[str, float]] = {
    "cpu": {"block": 128, "margin": 1, "min_dense_flops": 0},
    "gpu": {"block": 1024, "margin": 4, "min_dense_flops": 1e12},
}

__all__ = [
    "BLOCKED_RULES",
    "DISPATCHES",
    "blocked_is_cheaper",
    "expert_parallel_experts",
    "dense_experts",
    "grouped_experts",
    "blocked_experts",
    "resolve_dispatch",
    "sort_by_expert",
]


def dense_experts(
    x: jax.Array, index: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """Every expert on every token, unchosen experts weighted 0: [T, E] -> [T, E]."""
    chosen = jax.nn.one_hot(index, gate.shape[0], dtype=weight.dtype)  # (T, K, X)
    weights = jnp.einsum("tk,tkx->tx", weight, chosen)  # (T, X); top-k indices are distinct
    h = jax.nn.silu(jnp.einsum("te,xem->txm", x, gate)) * jnp.einsum("te,xem->txm", x, up)
    # Weight before the down projection (linear): no [T, X, E] intermediate.
    return jnp.einsum("txm,xme->te", h * weights[..., None], down)


def sort_by_expert(index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, group_sizes): ``order`` [T * K] lists the flattened (token, slot) pairs
    ``t * K + k`` expert by expert (stable: token order within an expert), ``group_sizes``
    [X] int32 counts them (0 for an expert no token chose)."""
    flat = index.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def grouped_experts(
    x: jax.Array, index: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """Each token through its K experts only, via ``ragged_dot`` over expert-sorted rows."""
    tokens, k = index.shape
    order, sizes = sort_by_expert(index, gate.shape[0])
    rows = x[order // k]  # (T*K, E)
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    h = h * weight.reshape(-1)[order][:, None]
    y = jax.lax.ragged_dot(h, down, sizes)  # (T*K, E), expert-sorted
    # Un-sort with the inverse permutation -- a gather, whose gradient is a scatter of
    # distinct rows -- then add each token's K slots.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return y[inverse].reshape(tokens, k, -1).sum(axis=1)


class BlockLayout(NamedTuple):
    """Where each (token, slot) pair goes when each expert's sorted rows start a new block.

    ``pair_slot`` [T * K]: the padded row of each pair (B * block for a dropped pair);
    ``slot_pair`` [B * block]: the pair in each padded row (T * K for padding); ``block_expert``
    [B]: the expert of each block; ``used`` (scalar): the blocks that hold any pair (the first
    ``used``; the rest are padding).  B = ceil(T * K / block) + X >= sum over experts of
    ceil(size / block)."""

    pair_slot: jax.Array
    slot_pair: jax.Array
    block_expert: jax.Array
    used: jax.Array


def block_layout(index: jax.Array, num_experts: int, block: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``index`` [T, K]; a pair routed to expert ``num_experts``
    (one past the last) is dropped: it gets no row and contributes nothing."""
    pairs = index.size
    order, sizes = sort_by_expert(index, num_experts + 1)  # the dropped pairs sort last
    sizes = sizes[:num_experts]
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    expert = index.reshape(-1)[order]  # (T*K,) the expert of each sorted row
    kept = expert < num_experts
    expert = jnp.minimum(expert, num_experts - 1)
    rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[expert]  # row within its expert
    blocks = -(-pairs // block) + num_experts
    slot = jnp.where(kept, (padded_end - padded)[expert] + rank, blocks * block)
    pair_slot = jnp.zeros(pairs, jnp.int32).at[order].set(slot)
    slot_pair = jnp.full(blocks * block, pairs, jnp.int32)
    slot_pair = slot_pair.at[pair_slot].set(jnp.arange(pairs, dtype=jnp.int32), mode="drop")
    # Blocks past the last expert's end hold padding only; any valid expert will do for them.
    # (A count, not jnp.searchsorted: that fails to trace inside a partly manual shard_map in jax
    # 0.10, and [B, X] comparisons are nothing next to the blocks' matmuls.)
    block_expert = jnp.sum(padded_end[None, :] <= (jnp.arange(blocks) * block)[:, None], axis=1)
    return BlockLayout(pair_slot, slot_pair, jnp.minimum(block_expert, num_experts - 1), padded_end[-1] // block)


def blocked_experts(
    x: jax.Array,
    index: jax.Array,
    weight: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    block: int = 128,
    skip_empty: bool = False,
) -> jax.Array:
    """Each token through its K experts only: expert-sorted rows in blocks of ``block`` rows,
    one expert per block, scanned with plain dots (capacity-free; see the module docstring).
    A pair routed to expert X (one past the last) is dropped (the expert-parallel dispatch's
    other ranks' experts).  ``skip_empty``: the padding blocks past the used ones run nothing
    (a ``cond`` per block; worth it where most of the static bound is padding)."""
    tokens, k = index.shape
    layout = block_layout(index, gate.shape[0], block)
    # Padding rows read token T / pair T*K: out of range, filled with 0 (and get no gradient).
    rows = x.at[layout.slot_pair // k].get(mode="fill", fill_value=0).reshape(-1, block, x.shape[1])
    weights = weight.reshape(-1).at[layout.slot_pair].get(mode="fill", fill_value=0).reshape(-1, block, 1)

    def run(r: jax.Array, w: jax.Array, j: jax.Array) -> jax.Array:
        h = jax.nn.silu(r @ gate[j]) * (r @ up[j])
        return (h * w) @ down[j]

    def one_block(_, xs):
        r, w, j, live = xs
        if not skip_empty:
            return None, run(r, w, j)
        return None, jax.lax.cond(live, run, lambda r, w, j: jnp.zeros_like(r), r, w, j)

    live = jnp.arange(layout.block_expert.shape[0]) < layout.used
    # A scan, not one batched einsum over gate[block_expert]: no [B, E, M] gathered copies of
    # the kernels (and faster on CPU, measured).  Each block's activations are recomputed in the
    # backward rather than saved: stacking the saved ones cost more than the recompute
    # (benchmarks.moe_dispatch on CPU: docs/results.md#kernels-attention-and-moe-dispatch).
    _, y = jax.lax.scan(jax.checkpoint(one_block), None, (rows, weights, layout.block_expert, live))
    y = y.reshape(-1, x.shape[1]).at[layout.pair_slot].get(mode="fill", fill_value=0)
    return y.reshape(tokens, k, -1).sum(axis=1)


def expert_parallel_experts(
    x: jax.Array,
    index: jax.Array,
    weight: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    axis: str,
    block: int,
) -> jax.Array:
    """One rank's part of an expert-parallel layer, inside ``shard_map`` manual over ``axis``.

    x [T, E], index / weight [T, K]: this rank's tokens and their routing; gate / up [X / n, E,
    M], down [X / n, M, E]: this rank's experts (rank r holds experts r X / n ... (r + 1) X / n
    - 1, as the ``expert`` axis shards them).  Every rank's tokens are gathered (all-gather
    token dispatch), each rank runs the pairs routed to its own experts through the blocked
    dispatch (the others dropped, the empty blocks skipped: about T * K / n pairs each when the
    routing is balanced), and the partial outputs are summed back onto the ranks that own the
    tokens (reduce-scatter).  Returns this rank's tokens' output [T, E]."""
    rank, local = jax.lax.axis_index(axis), gate.shape[0]
    x_all, index_all, weight_all = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, index, weight))
    mine = (index_all >= rank * local) & (index_all < (rank + 1) * local)
    local_index = jnp.where(mine, index_all - rank * local, local)  # `local`: dropped
    y = blocked_experts(
        x_all, local_index, jnp.where(mine, weight_all, 0), gate, up, down, block=block, skip_empty=True
    )
    return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)


def blocked_rule(platform: str) -> dict[str, float]:
    """``BLOCKED_RULES`` of ``platform`` (a platform not measured takes the GPU's)."""
    return BLOCKED_RULES.get(platform, BLOCKED_RULES["gpu"])


def blocked_is_cheaper(tokens: int, experts: int, top_k: int, embed: int, mlp: int, platform: str) -> bool:
    """Whether the model's "blocked" scans blocks for a [tokens] micro batch (see BLOCKED_RULES)."""
    rule = blocked_rule(platform)
    fewer_rows = tokens * (experts - top_k) > rule["margin"] * experts * rule["block"]
    return fewer_rows and 6 * tokens * experts * embed * mlp >= rule["min_dense_flops"]


def blocked_where_cheaper(
    x: jax.Array, index: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """``blocked_experts`` where it is faster than ``dense_experts`` on this platform, else dense
    (decided at trace time from the static shapes; ``BLOCKED_RULES``): decoding steps and short
    micro batches stay dense."""
    (tokens, k), (experts, embed, mlp) = index.shape, gate.shape
    platform = jax.default_backend()
    if not blocked_is_cheaper(tokens, experts, k, embed, mlp, platform):
        return dense_experts(x, index, weight, gate, up, down)
    return blocked_experts(x, index, weight, gate, up, down, block=int(blocked_rule(platform)["block"]))


#: ``policy.jax_cfg.moe_dispatch`` -> the function (``auto`` is resolved by :func:`resolve_dispatch`).
DISPATCHES = {"dense": dense_experts, "blocked": blocked_where_cheaper, "grouped": grouped_experts}


def resolve_dispatch(name: str, platform: str) -> str:
    """``auto``: ``blocked`` on CPU and GPU (which runs dense where that is faster:
    ``BLOCKED_RULES``, measured on both), ``dense`` elsewhere (TPU not measured).  ``grouped``
    is never chosen: ``ragged_dot`` lowers to its dense reference expansion on CPU and, in JAX
    0.11, on GPU (K x dense's FLOPs; on one H100 it asked for 64 GiB for 16,384 tokens of the
    Qwen3-30B-A3B layer)."""
    if name == "auto":
        return "blocked" if platform in BLOCKED_RULES else "dense"
    if name not in DISPATCHES:
        raise ValueError(f"policy.jax_cfg.moe_dispatch={name!r}: one of auto, {', '.join(DISPATCHES)}")
    return name
