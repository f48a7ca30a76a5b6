"""Router statistics of a mixture-of-experts layer stack, for torch tensors and jax arrays.

The load-balancing loss is the Switch Transformer's (Fedus et al. 2021, eqs. 4-6), as HF's
``load_balancing_loss_func`` computes it for Qwen3-MoE / Mixtral: over the tokens a
statistic covers, with ``f_x`` the fraction of (token, top-k slot) assignments that chose
expert ``x`` and ``P_x`` the mean router probability of ``x`` (both pooled over the sparse
layers, as HF pools them),

    aux = num_experts * sum_x f_x * P_x          (= top_k when the load is uniform).

HF pools over a whole batch.  Here it is computed **per sequence** (DeepSeek-V2/V3's
sequence-wise variant), and a batch's value is the mean over its sequences: a sum over
sequences is what the losses' global normalisation makes independent of micro-batch size,
data-parallel rank count and padding rows, so every backend and layout trains on the same
number.  For a batch of one sequence it is exactly HF's value (tested).

Routing replay (``policy.moe.routing_replay``; Rollout Routing Replay, R3, and its
old-logprob-pass form): a forward told which experts each token goes to keeps them and
takes their weights from its own router, ``softmax(logits)[chosen]`` (renormalised when the
model's ``norm_topk_prob``), so the router still learns through the replayed choice.

Expert choices travel in the batch as ``routed_experts`` [B, S, sparse layers, top_k] (rows
first, so they are sharded and micro-batched with the rows).
"""

from __future__ import annotations

from core.kernels.ops import EPS, ops_for


def token_mask(input_lengths, width: int, like):
    """[B, width] 1.0 on each row's first ``input_lengths`` tokens, 0 on its right padding."""
    ops = ops_for(like)
    cols = ops.expand_dims(ops.arange(width, like), 0)
    return ops.astype(cols < ops.expand_dims(input_lengths, -1), like.dtype)


def router_load_balancing_loss(router_logits, input_lengths, top_k: int):
    """Per-sequence load-balancing loss [B] (compute dtype, differentiable in the logits).

    ``router_logits`` [L, B, S, X]: the router's logits at every sparse layer (L of them),
    row and position; ``input_lengths`` [B]: each row's real tokens (padding is left out;
    a row without tokens gives 0).  The top-k choice carries no gradient (an indicator), the
    probabilities do, as in HF.
    """
    ops = ops_for(router_logits)
    layers, _, width, experts = router_logits.shape
    probs = ops.softmax(ops.to_compute(router_logits))  # (L, B, S, X)
    chosen = ops.sum(ops.one_hot(ops.top_k_indices(probs, top_k), experts, probs.dtype), axis=-2)
    mask = ops.expand_dims(ops.expand_dims(token_mask(input_lengths, width, probs), 0), -1)  # (1, B, S, 1)
    assigned = ops.sum(ops.sum(chosen * mask, axis=2), axis=0)  # (B, X): assignments per expert
    prob_mass = ops.sum(ops.sum(probs * mask, axis=2), axis=0)  # (B, X): router probability per expert
    pooled = layers * ops.sum(mask, axis=(0, 2, 3))  # (B,): tokens x layers
    return experts * ops.sum(assigned * prob_mass, axis=-1) / (pooled * pooled + EPS)


def top_k_experts(router_logits, top_k: int):
    """[..., top_k] the experts the router picks, as HF picks them (top-k of the float32
    softmax, largest first)."""
    ops = ops_for(router_logits)
    return ops.top_k_indices(ops.softmax(ops.to_compute(router_logits)), top_k)


def routed_experts_of(router_logits, top_k: int):
    """The ``routed_experts`` layout [B, S, L, top_k] of the experts the router of ``router_logits``
    [L, B, S, X] picks (integer; the backends store them as int16)."""
    ops = ops_for(router_logits)
    return ops.moveaxis(top_k_experts(router_logits, top_k), 0, 2)


def replayed_routing_weights(router_logits, experts, normalize: bool):
    """[..., K] the router's weights of the given ``experts`` [..., K]: its float32 softmax
    probabilities there, renormalised to sum 1 when ``normalize`` (``norm_topk_prob``), in the
    logits' dtype -- what HF's router returns for its own top-k, for a replayed choice."""
    ops = ops_for(router_logits)
    weights = ops.gather_last(ops.softmax(ops.to_compute(router_logits)), experts)
    if normalize:
        weights = weights / ops.sum(weights, axis=-1, keepdims=True)
    return ops.astype(weights, router_logits.dtype)


def routing_agreement(router_logits, routed_experts):
    """[B, S] per token: the share of its ``top_k`` experts that the router of this forward
    (``router_logits`` [L, B, S, X]) picks among the ``routed_experts`` [B, S, L, K] another
    pass chose, averaged over the L sparse layers (1 = the same set everywhere)."""
    ops = ops_for(router_logits)
    layers, top_k = router_logits.shape[0], routed_experts.shape[-1]
    mine = ops.expand_dims(top_k_experts(router_logits, top_k), -1)  # (L, B, S, K, 1)
    theirs = ops.expand_dims(ops.moveaxis(routed_experts, 2, 0), -2)  # (L, B, S, 1, K)
    shared = ops.sum(ops.sum(ops.astype(mine == ops.astype(theirs, mine.dtype), router_logits.dtype), -1), -1)
    return ops.sum(ops.to_compute(shared), axis=0) / (layers * top_k)
