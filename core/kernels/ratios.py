"""Policy-ratio kernels: PPO clipping, dual clip, GSPO sequence ratios, importance sampling.

All functions take per-token arrays [B, T] (already sliced to next-token positions) and
return arrays of the same shape unless stated.
"""

from __future__ import annotations

from core.kernels.ops import ops_for
from core.kernels.reductions import masked_mean

TRUNCATED_IS_TYPES = ("tis", "icepop", "seq-mask-tis")


def clipped_surrogate_loss(ratios, advantages, clip_min: float, clip_max: float, clip_c: float | None = None):
    """Per-token PPO objective (to minimise) with asymmetric and dual clipping.

    loss = max(-A * r, -A * clip(r, 1 - clip_min, 1 + clip_max)); ``clip_max > clip_min`` is
    "clip-higher" (DAPO).  With ``clip_c`` (dual clip, Ye et al. 2019) the loss of a negative
    advantage is further bounded by ``-A * clip_c`` so one huge ratio cannot dominate.

    Returns ``(loss, ratios_clamped)``.
    """
    ops = ops_for(ratios, advantages)
    ratios_clamped = ops.clip(ratios, 1.0 - clip_min, 1.0 + clip_max)
    loss = ops.maximum(-advantages * ratios, -advantages * ratios_clamped)
    return dual_clip(loss, advantages, clip_c), ratios_clamped


def dual_clip(loss, advantages, clip_c: float | None):
    """Bound the per-token loss of negative advantages by ``-A * clip_c`` (no-op for None)."""
    if clip_c is None:
        return loss
    if clip_c <= 1:
        raise ValueError(f"ratio_clip_c must be > 1 for dual clipping, got {clip_c}")
    ops = ops_for(loss, advantages)
    return ops.where(advantages < 0, ops.minimum(loss, -advantages * clip_c), loss)


def sequence_level_ratio(log_ratio, token_mask):
    """GSPO's sequence ratio exp(mean_t log r_t) over each sequence's valid tokens, [B, 1].

    Broadcast it over tokens to use it in ``clipped_surrogate_loss``; its gradient w.r.t.
    each token logprob is r_seq / |y|, which is GSPO's (Zheng et al. 2025).
    """
    ops = ops_for(log_ratio)
    return ops.exp(ops.expand_dims(masked_mean(log_ratio, token_mask, axis=-1), -1))


def truncated_importance_weights(
    log_ratio,
    token_mask,
    kind: str,
    ratio_max: float,
    ratio_min: float | None = None,
):
    """Correct for the train/generation mismatch: weights from log(pi_old / pi_gen) [B, T].

    kind:
      ``tis``           w = min(r, ratio_max)                     (truncated IS)
      ``icepop``        w = r where ratio_min <= r <= ratio_max else 0   (token masking)
      ``seq-mask-tis``  whole sequences whose geometric-mean ratio falls outside
                        [ratio_min, ratio_max] get w = 0; kept tokens keep their raw r.

    Returns ``(weights, out_of_bounds)`` where ``out_of_bounds`` is a 0/1 float array marking
    the tokens that were truncated or masked (for the ``is_oob_ratio`` metric).
    """
    ops = ops_for(log_ratio)
    if kind not in TRUNCATED_IS_TYPES:
        raise ValueError(f"truncated_importance_sampling_type must be one of {TRUNCATED_IS_TYPES}, got {kind!r}")
    if kind != "tis" and ratio_min is None:
        raise ValueError(f"truncated_importance_sampling_type={kind!r} needs truncated_importance_sampling_ratio_min")
    ratio = ops.exp(log_ratio)
    zeros = ops.zeros_like(ratio)
    if kind == "tis":
        oob = ratio > ratio_max
        weights = ops.minimum(ratio, ops.ones_like(ratio) * ratio_max)
    elif kind == "icepop":
        oob = (ratio > ratio_max) | (ratio < ratio_min)
        weights = ops.where(oob, zeros, ratio)
    else:
        seq_ratio = sequence_level_ratio(log_ratio, token_mask)  # [B, 1]
        seq_oob = (seq_ratio > ratio_max) | (seq_ratio < ratio_min)
        oob = seq_oob & (ops.ones_like(ratio) > 0)  # broadcast [B, 1] -> [B, T]
        weights = ops.where(oob, zeros, ratio)
    return weights, ops.astype(oob, ratio.dtype)
