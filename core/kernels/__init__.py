"""The shared kernel suite: written once, run on torch tensors and on jax arrays.

Every function dispatches on the type of its array arguments (see ``core.kernels.ops``);
none imports torch or jax until called with one of their arrays.
"""

from core.kernels.kl import KL_TYPES, calculate_kl
from core.kernels.logprobs import (
    apply_temperature,
    auto_chunk_size,
    entropy_from_logits,
    logprobs_from_logits,
    logprobs_to_sequence_layout,
    next_token_logprobs,
)
from core.kernels.ops import ops_for
from core.kernels.ratios import (
    TRUNCATED_IS_TYPES,
    clipped_surrogate_loss,
    dual_clip,
    sequence_level_ratio,
    truncated_importance_weights,
)
from core.kernels.reductions import masked_mean, masked_sum
from core.kernels.rollout_metrics import generation_policy_kl, token_mult_prob_error, token_mult_prob_excess

__all__ = [
    "KL_TYPES",
    "TRUNCATED_IS_TYPES",
    "apply_temperature",
    "auto_chunk_size",
    "calculate_kl",
    "clipped_surrogate_loss",
    "dual_clip",
    "entropy_from_logits",
    "generation_policy_kl",
    "logprobs_from_logits",
    "logprobs_to_sequence_layout",
    "masked_mean",
    "masked_sum",
    "next_token_logprobs",
    "ops_for",
    "sequence_level_ratio",
    "token_mult_prob_error",
    "token_mult_prob_excess",
    "truncated_importance_weights",
]
