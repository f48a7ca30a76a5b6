"""The loss sections: ``loss_fn`` (GRPO's clipped policy gradient) and DPO's loss keys
(NeMo RL's names).  Nothing here imports torch or jax."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from core.config import ConfigModel, Problem


class ClippedPGLossConfig(ConfigModel):
    """PPO/GRPO clipped policy-gradient loss (NeMo RL's ``ClippedPGLossFn``)."""

    reference_policy_kl_penalty: float = Field(ge=0)
    """KL(policy || reference) coefficient; 0 disables the KL term."""
    ratio_clip_min: float = Field(ge=0)
    """Epsilon below 1: the ratio is clipped to 1 - ratio_clip_min."""
    ratio_clip_max: float = Field(ge=0)
    """Epsilon above 1: the ratio is clipped to 1 + ratio_clip_max."""
    ratio_clip_c: float | None
    """Dual-clip constant (> 1); null disables dual clipping."""
    use_on_policy_kl_approximation: bool
    """Importance-weight the KL estimate."""
    use_importance_sampling_correction: bool
    """Correct for the generation / training logprob mismatch."""
    token_level_loss: bool
    """Mean over tokens (true) or over sequences (false)."""
    token_normalizer: Literal["global_tokens", "constant"] = "global_tokens"
    """What a token-level loss divides the global batch's summed token losses by: global_tokens,
    the count of valid tokens (DAPO's token-level mean); constant, valid sequences x
    constant_token_budget, a denominator no response length moves (Dr. GRPO, Liu et al. 2025).
    Needs token_level_loss: true."""
    constant_token_budget: int | None = Field(None, ge=1)
    """Tokens per sequence of the constant normaliser (Dr. GRPO's MAX_TOKENS); null = the longest
    response dualrl grpo generates (policy.generation.max_new_tokens as cut to fit
    max_total_sequence_length).  Only with token_normalizer: constant."""
    disable_ppo_ratio: bool = False
    """REINFORCE: no ratio, no clipping."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_input_clamp_value: float | None = Field(20.0, gt=0)
    """Clamp the log-ratio fed into the KL estimator; null = no clamp."""
    kl_output_clamp_value: float | None = Field(10.0, gt=0)
    """Clamp the per-token KL value; null = no clamp."""
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    """Upper bound of the importance weight; null = no truncation."""
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    """Lower bound (icepop / seq-mask-tis)."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] = "tis"
    """tis: clip the weight; icepop: zero tokens outside [min, max]; seq-mask-tis: mask whole sequences."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence."""

    def check(self) -> Iterable[Problem]:
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            yield "ratio_clip_c", f"must be > 1 (or null to disable dual clipping), got {self.ratio_clip_c!r}"
        yield from self._truncation_problems()
        yield from self._normalizer_problems()
        if self.sequence_level_importance_ratios and self.token_level_loss:
            yield (
                "sequence_level_importance_ratios",
                "requires token_level_loss: false (GSPO's sequence-level ratios need a sequence-level loss)",
            )

    def _normalizer_problems(self) -> Iterable[Problem]:
        if self.token_normalizer == "constant" and not self.token_level_loss:
            yield (
                "token_normalizer",
                "constant needs token_level_loss: true (a sequence-level loss divides each sequence by its own "
                "length, which is what the constant normaliser replaces)",
            )
        if self.constant_token_budget is not None and self.token_normalizer != "constant":
            yield (
                "constant_token_budget",
                f"is set ({self.constant_token_budget}) but token_normalizer is {self.token_normalizer!r}; "
                "only the constant normaliser reads it",
            )

    def _truncation_problems(self) -> Iterable[Problem]:
        tis, tis_min, kind = (
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
            self.truncated_importance_sampling_type,
        )
        if tis is None:
            return
        if not self.use_importance_sampling_correction:
            yield (
                "truncated_importance_sampling_ratio",
                f"is set ({tis!r}) but use_importance_sampling_correction is false; "
                "truncation only applies to the importance-sampling correction",
            )
        if kind in ("icepop", "seq-mask-tis"):
            if tis_min is None:
                yield (
                    "truncated_importance_sampling_ratio_min",
                    f"required when truncated_importance_sampling_type is {kind!r}",
                )
            elif tis_min > tis:
                yield (
                    "truncated_importance_sampling_ratio_min",
                    f"{tis_min!r} is greater than truncated_importance_sampling_ratio ({tis!r})",
                )


class DPOLossConfig(ConfigModel):
    """Direct preference optimisation loss (NeMo RL's ``DPOLossFn``)."""

    reference_policy_kl_penalty: float = Field(gt=0)
    """DPO's beta."""
    preference_loss_weight: float = Field(ge=0)
    """Weight of the preference (sigmoid) term."""
    sft_loss_weight: float = Field(ge=0)
    """Weight of the NLL on the chosen response."""
    preference_average_log_probs: bool
    """Average (not sum) token log-probs in the preference term."""
    sft_average_log_probs: bool
    """Average (not sum) token log-probs in the SFT term."""
