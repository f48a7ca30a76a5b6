"""How far the generation engine's sampling distribution is from the trained policy's.

Both compare per-token logprobs of the *generated* tokens: ``generation_logprobs`` as the
engine reported them while sampling, ``policy_logprobs`` from ``Policy.get_logprobs`` on the
same sequences.  A refit that lost or mangled a weight shows up here first.
"""

from __future__ import annotations

from core.kernels.kl import calculate_kl
from core.kernels.ops import ops_for
from core.kernels.reductions import masked_mean


def _masked_inputs(ops, generation_logprobs, policy_logprobs, mask):
    """Both logprobs in the compute dtype, zeroed where ``mask`` is 0: prompt and padding
    positions may hold anything (-inf, or values whose exp overflows), and ``inf * 0`` in
    the masked mean would turn the whole metric into NaN."""
    gen = ops.to_compute(generation_logprobs)
    pol = ops.to_compute(policy_logprobs)
    valid = ops.astype(mask, gen.dtype) != 0
    return ops.where(valid, gen, ops.zeros_like(gen)), ops.where(valid, pol, ops.zeros_like(pol))


def token_mult_prob_error(generation_logprobs, policy_logprobs, mask, global_normalization_factor=None):
    """Mean over valid tokens of ``exp(|lp_gen - lp_policy|)``: the typical factor by which
    the two assign different probability to a sampled token.  1.0 is exact agreement;
    NeMo RL flags runs above ~1.05.  ``mask`` marks generated (not prompt/padding) tokens;
    ``global_normalization_factor`` as in ``masked_mean`` (a loss reports per-micro-batch
    shares of the global-batch value).
    """
    ops = ops_for(generation_logprobs, policy_logprobs)
    gen, pol = _masked_inputs(ops, generation_logprobs, policy_logprobs, mask)
    return masked_mean(ops.exp(ops.abs(gen - pol)), mask, global_normalization_factor=global_normalization_factor)


def token_mult_prob_excess(generation_logprobs, policy_logprobs, mask, global_normalization_factor=None):
    """``token_mult_prob_error - 1`` as ``mean(expm1(|lp_gen - lp_policy|))``: 0 exactly when
    every token's logprobs agree.  What a loss reports per micro batch: summed over micro
    batches and ranks its shares stay exactly 0 for exact agreement, while shares of the
    error itself (each near ``1 / micro batches``) need not sum to exactly 1.0
    (``core.losses.metrics.whole_batch_metrics`` adds the 1 back once)."""
    ops = ops_for(generation_logprobs, policy_logprobs)
    gen, pol = _masked_inputs(ops, generation_logprobs, policy_logprobs, mask)
    return masked_mean(ops.expm1(ops.abs(gen - pol)), mask, global_normalization_factor=global_normalization_factor)


def generation_policy_kl(
    generation_logprobs, policy_logprobs, mask, kl_type: str = "k3", global_normalization_factor=None
):
    """Masked-mean estimate of KL(generation || policy) from tokens sampled by the engine
    (k3 by default: unbiased and non-negative)."""
    ops = ops_for(generation_logprobs, policy_logprobs)
    gen, pol = _masked_inputs(ops, generation_logprobs, policy_logprobs, mask)
    # calculate_kl(lp, lp_ref) estimates KL(pi || pi_ref) under samples from pi.
    kl = calculate_kl(gen, pol, kl_type=kl_type, input_clamp_value=None, output_clamp_value=None)
    return masked_mean(kl, mask, global_normalization_factor=global_normalization_factor)
