"""KL estimators between the policy and a reference, from per-token logprobs.

With ``logr = log pi_ref(x) - log pi(x)`` for tokens x sampled from pi (Schulman, 2020):
  k1 = -logr                      unbiased, high variance, can be negative
  k2 = logr**2 / 2                biased, low variance
  k3 = exp(logr) - 1 - logr       unbiased, low variance, always >= 0 (GRPO's choice)
Clamping ``logr`` before and the estimate after guards against the exp() blow-up when a
token is far more likely under the policy than under the reference.
"""

from __future__ import annotations

from core.kernels.ops import ops_for

KL_TYPES = ("k1", "k2", "k3")


def calculate_kl(
    logprobs,
    logprobs_reference,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
):
    """Per-token KL(pi || pi_ref) estimate; same shape as ``logprobs``."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    ops = ops_for(logprobs, logprobs_reference)
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        logr = ops.clip(logr, -input_clamp_value, input_clamp_value)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = ops.square(logr) / 2
    else:
        kl = ops.exp(logr) - 1 - logr
    if output_clamp_value is not None:
        kl = ops.clip(kl, -output_clamp_value, output_clamp_value)
    return kl
