"""Direct Preference Optimisation loss (NeMo RL's ``DPOLossFn``), torch or jax.

Rows come in pairs: chosen responses at even rows, rejected at odd rows.  The implicit
reward of a response is sum_t (log pi(x_t) - log pi_ref(x_t)) over its valid tokens (or
the mean, with ``preference_average_log_probs``), and

    L = preference_loss_weight * mean_pairs[-log sigmoid(beta * (r_chosen - r_rejected))]
      + sft_loss_weight * mean_chosen[NLL]

Means run over valid pairs of the global batch: ``global_valid_seqs / 2``.
Unlike NeMo RL, ``reference_policy_logprobs`` uses the ``get_logprobs`` layout like every
other per-token key (sliced ``[:, 1:]``): no roll by one is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.interfaces import LossType
from core.kernels import masked_mean, next_token_logprobs, ops_for
from core.losses.checks import LossInputChecker
from core.losses.config import DPOLossConfig
from core.losses.contract import DeclaredLoss
from core.losses.nll import per_sequence_logprob, sequence_masks


class DPOLossFn(DeclaredLoss):
    """DPO with an optional SFT term on the chosen responses; see the module docstring."""

    loss_type = LossType.SEQUENCE_LEVEL

    def __init__(self, cfg: DPOLossConfig | Mapping[str, Any]):
        self.cfg = DPOLossConfig.coerce(cfg, path="loss_fn")
        self.check = LossInputChecker(
            "DPOLossFn", ("reference_policy_logprobs", "token_mask"), finite_keys=("reference_policy_logprobs",)
        )

    @property
    def uses_reference(self) -> bool:
        """The implicit rewards are log-ratios to the reference policy."""
        return True

    def __call__(self, next_token_logits, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        batch, _ = self.check(next_token_logits, data)
        if batch % 2:
            self.check.fail(
                f"needs (chosen, rejected) row pairs but the batch has {batch} rows; micro batch sizes must be even"
            )
        curr_logprobs = next_token_logprobs(next_token_logits, data["input_ids"])
        return self.loss_from_logprobs(curr_logprobs, data, global_valid_seqs, global_valid_toks)

    def loss_from_logprobs(self, curr_logprobs, data, global_valid_seqs, global_valid_toks):
        ops = ops_for(curr_logprobs)
        dtype = curr_logprobs.dtype
        token_mask, sample_mask, mask = sequence_masks(ops, data, dtype)
        if global_valid_seqs is None:
            global_valid_seqs = ops.sum(sample_mask)
        pairs = global_valid_seqs / 2
        ref = ops.where(mask > 0, ops.astype(data["reference_policy_logprobs"][:, 1:], dtype), 0.0)

        rewards = per_sequence_logprob(curr_logprobs - ref, mask, self.cfg.preference_average_log_probs)
        chosen, rejected = rewards[0::2], rewards[1::2]
        chosen_mask, rejected_mask = sample_mask[0::2], sample_mask[1::2]
        per_pair = -ops.log_sigmoid(self.cfg.reference_policy_kl_penalty * (chosen - rejected))
        preference_loss = masked_mean(per_pair, chosen_mask, global_normalization_factor=pairs)

        sft_loss = ops.zeros((), like=curr_logprobs)
        if self.cfg.sft_loss_weight > 0:
            nll = -per_sequence_logprob(curr_logprobs, mask, self.cfg.sft_average_log_probs)
            sft_loss = masked_mean(nll[0::2], chosen_mask, global_normalization_factor=pairs)
        loss = self.cfg.preference_loss_weight * preference_loss + self.cfg.sft_loss_weight * sft_loss

        sg = ops.stop_gradient
        accuracy = ops.astype(chosen > rejected, dtype)
        return loss, {
            "loss": sg(loss),
            "sft_loss": sg(sft_loss),
            "preference_loss": sg(preference_loss),
            "accuracy": sg(masked_mean(accuracy, chosen_mask, global_normalization_factor=pairs)),
            "rewards_chosen_mean": sg(masked_mean(chosen, chosen_mask, global_normalization_factor=pairs)),
            "rewards_rejected_mean": sg(masked_mean(rejected, rejected_mask, global_normalization_factor=pairs)),
            "num_valid_samples": sg(ops.sum(sample_mask) / 2),
        }
