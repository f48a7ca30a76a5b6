"""PPO/GRPO clipped policy-gradient loss (NeMo RL's ``ClippedPGLossFn``), torch or jax.

    L = actor_loss + beta * KL(pi || pi_ref)
    actor_loss = mean_t[ w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_lo, 1 + eps_hi)) ]

with r_t = pi(x_t) / pi_old(x_t) (or exp(mean log r) per sequence for GSPO, or
log pi(x_t) itself for REINFORCE when ``disable_ppo_ratio``), an optional dual clip, and
w_t the importance weight pi_old / pi_gen correcting for the trainer/generator mismatch
(optionally truncated: tis / icepop / seq-mask-tis).

Token-level loss averages over all valid tokens of the global batch (``token_normalizer:
global_tokens``) or divides their sum by valid sequences x ``constant_token_budget``
(``constant``, Dr. GRPO: no response length moves the denominator); sequence-level loss
averages per sequence first, then over the valid sequences of the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.interfaces import LossType, OldLogprobsSource
from core.kernels import (
    calculate_kl,
    clipped_surrogate_loss,
    dual_clip,
    generation_policy_kl,
    masked_mean,
    next_token_logprobs,
    ops_for,
    sequence_level_ratio,
    token_mult_prob_error,
    token_mult_prob_excess,
    truncated_importance_weights,
)
from core.losses.checks import LossInputChecker
from core.losses.config import ClippedPGLossConfig
from core.losses.contract import DeclaredLoss

#: Where the old policy's logprobs (the PPO ratio's denominator) come from: ``"batch"`` reads
#: ``data["prev_logprobs"]`` (a separate ``get_logprobs`` pass before training); ``"forward"``
#: takes the training forward's own logprobs, detached -- exact when the rollout batch gets one
#: optimizer step, as the weights that scored it are the ones being trained (TRL does the same
#: with one iteration), and it saves a forward pass over the batch.
OLD_LOGPROBS: tuple[OldLogprobsSource, ...] = ("batch", "forward")


class ClippedPGLossFn(DeclaredLoss):
    """Clipped policy-gradient loss; config keys and semantics as NeMo RL's.

    Call as ``loss_fn(next_token_logits [B,S,V], data, global_valid_seqs, global_valid_toks)``;
    per-token ``data`` keys are [B, S] aligned like ``get_logprobs`` output and sliced
    ``[:, 1:]``.  Returns ``(loss, metrics)``: a 0-d array of the input's engine and a dict
    of detached 0-d arrays, each globally normalised so that summing a metric over micro
    batches and ranks gives its value on the whole batch.
    """

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any], *, old_logprobs: OldLogprobsSource = "batch"):
        if old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"ClippedPGLossFn: old_logprobs must be one of {OLD_LOGPROBS}, got {old_logprobs!r}")
        self.cfg = ClippedPGLossConfig.coerce(cfg, path="loss_fn")
        if self.cfg.token_normalizer == "constant" and self.cfg.constant_token_budget is None:
            raise ValueError(
                "ClippedPGLossFn: loss_fn.constant_token_budget is null; give the tokens per sequence the constant "
                "normaliser divides by (dualrl grpo fills in the longest response it generates)"
            )
        self.old_logprobs: OldLogprobsSource = old_logprobs
        self.loss_type = LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        keys = ["advantages", "generation_logprobs"]
        keys += ["prev_logprobs"] if old_logprobs == "batch" else []
        keys += ["reference_policy_logprobs"] if self.uses_reference else []
        self.check = LossInputChecker("ClippedPGLossFn", [*keys, "token_mask"], finite_keys=keys)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads the reference policy's logprobs (a KL term)."""
        return self.cfg.reference_policy_kl_penalty != 0

    def __call__(self, next_token_logits, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        self.check(next_token_logits, data)
        curr_logprobs = next_token_logprobs(next_token_logits, data["input_ids"])
        return self.loss_from_logprobs(curr_logprobs, data, global_valid_seqs, global_valid_toks)

    def loss_from_logprobs(self, curr_logprobs, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        """The loss given the policy's next-token logprobs [B, S-1] (differentiable).

        Backends that compute logprobs themselves (vocab-parallel TP, packed sequences)
        call this directly.
        """
        ops = ops_for(curr_logprobs)
        dtype = curr_logprobs.dtype
        token_mask = ops.astype(data["token_mask"][:, 1:], dtype)
        sample_mask = ops.astype(data["sample_mask"], dtype)
        mask = token_mask * ops.expand_dims(sample_mask, -1)

        # Zero the inputs outside the mask so padding garbage (inf/NaN) cannot leak into the
        # loss or, through 0 * inf in a backward pass, into the gradients.
        def masked_input(key):
            return ops.where(mask > 0, ops.astype(data[key][:, 1:], dtype), 0.0)

        advantages = masked_input("advantages")
        gen_lp = masked_input("generation_logprobs")
        curr_lp = ops.where(mask > 0, curr_logprobs, 0.0)
        prev_lp = masked_input("prev_logprobs") if self.old_logprobs == "batch" else ops.stop_gradient(curr_lp)
        ref_lp = masked_input("reference_policy_logprobs") if self.uses_reference else None

        if global_valid_toks is None:
            global_valid_toks = ops.sum(mask)
        if global_valid_seqs is None:
            global_valid_seqs = ops.sum(sample_mask)

        token_norm = global_valid_toks
        if self.cfg.token_normalizer == "constant":
            # Dr. GRPO: sum_i sum_t loss_it / (N x budget); N = valid sequences of the global batch.
            token_norm = global_valid_seqs * self.cfg.constant_token_budget

        def reduce(per_token, token_level=self.loss_type == LossType.TOKEN_LEVEL):
            if token_level:
                return masked_mean(per_token, mask, global_normalization_factor=token_norm)
            per_seq = masked_mean(per_token, token_mask, axis=-1)
            return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)

        kl = self._kl_term(ops, curr_lp, gen_lp, ref_lp, reduce)
        ratios, ratios_clamped, clip_loss = self._clipped_objective(ops, curr_lp, prev_lp, advantages, token_mask)
        is_weights, is_oob, raw_is = self._importance_weights(ops, prev_lp, gen_lp, token_mask)
        actor_loss = reduce(is_weights * clip_loss)
        loss = actor_loss + kl

        metrics = self._metrics(
            ops,
            loss,
            actor_loss,
            kl,
            ratios,
            ratios_clamped,
            curr_lp,
            prev_lp,
            gen_lp,
            raw_is,
            is_oob,
            mask,
            sample_mask,
            global_valid_toks,
        )
        return loss, metrics

    # ------------------------------------------------------------------ pieces
    def _metrics(
        self,
        ops,
        loss,
        actor_loss,
        kl,
        ratios,
        ratios_clamped,
        curr_lp,
        prev_lp,
        gen_lp,
        raw_is,
        is_oob,
        mask,
        sample_mask,
        global_valid_toks,
    ):
        """Detached metrics, each normalised like the loss (they sum over micro batches)."""
        sg = ops.stop_gradient

        def tok_mean(x):
            return sg(masked_mean(x, mask, global_normalization_factor=global_valid_toks))

        beta = self.cfg.reference_policy_kl_penalty
        curr = sg(curr_lp)
        metrics = {
            "loss": sg(loss),
            "actor_loss": sg(actor_loss),
            "kl_penalty": sg(kl) / beta if beta != 0 else sg(kl),
            "probs_ratio": tok_mean(ratios),
            "probs_ratio_clamped": tok_mean(ratios_clamped),
            # Share of tokens whose ratio left the trust region (PPO's "clipfrac").
            "clip_fraction": tok_mean(ops.where(ops.abs(ratios - ratios_clamped) > 0, 1.0, 0.0)),
            # The same rollout-health metrics the refit reports, here per training batch.
            "token_mult_prob_error": sg(token_mult_prob_error(gen_lp, prev_lp, mask, global_valid_toks)),
            "token_mult_prob_excess": sg(token_mult_prob_excess(gen_lp, prev_lp, mask, global_valid_toks)),
            "gen_kl_error": sg(generation_policy_kl(gen_lp, prev_lp, mask, "k3", global_valid_toks)),
            "sampling_importance_ratio": tok_mean(raw_is),
            "is_oob_ratio": tok_mean(is_oob),
            "approx_entropy": tok_mean(-ops.exp(curr - gen_lp) * curr),
            "num_valid_samples": sg(ops.sum(sample_mask)),
        }
        return metrics

    def _kl_term(self, ops, curr_lp, gen_lp, ref_lp, reduce):
        if ref_lp is None:
            return ops.zeros((), like=curr_lp)
        kl = calculate_kl(
            curr_lp,
            ref_lp,
            self.cfg.reference_policy_kl_type,
            self.cfg.kl_input_clamp_value,
            self.cfg.kl_output_clamp_value,
        )
        if self.cfg.use_on_policy_kl_approximation:
            # samples come from pi_gen, the KL is an expectation under pi: reweight by pi / pi_gen
            weights = ops.nan_to_num(ops.exp(ops.stop_gradient(curr_lp) - gen_lp))
            kl = weights * kl
        return self.cfg.reference_policy_kl_penalty * reduce(kl)

    def _clipped_objective(self, ops, curr_lp, prev_lp, advantages, token_mask):
        if self.cfg.disable_ppo_ratio:
            # REINFORCE: the "ratio" is log pi itself, so -A * log pi is the plain policy gradient
            # (NeMo RL applies the dual clip here too; kept for parity)
            return curr_lp, curr_lp, dual_clip(-advantages * curr_lp, advantages, self.cfg.ratio_clip_c)
        log_ratio = curr_lp - prev_lp
        if self.cfg.sequence_level_importance_ratios:
            ratios = sequence_level_ratio(log_ratio, token_mask) * ops.ones_like(log_ratio)
        else:
            ratios = ops.exp(log_ratio)
        clip_loss, ratios_clamped = clipped_surrogate_loss(
            ratios, advantages, self.cfg.ratio_clip_min, self.cfg.ratio_clip_max, self.cfg.ratio_clip_c
        )
        return ratios, ratios_clamped, clip_loss

    def _importance_weights(self, ops, prev_lp, gen_lp, token_mask):
        """Weights pi_old / pi_gen (constants: no gradient) and the out-of-bounds marker."""
        log_w = prev_lp - gen_lp
        zeros = ops.zeros_like(log_w)
        if self.cfg.sequence_level_importance_ratios:
            raw = sequence_level_ratio(log_w, token_mask) * ops.ones_like(log_w)
        else:
            raw = ops.nan_to_num(ops.exp(log_w))
        if not self.cfg.use_importance_sampling_correction:
            return ops.ones_like(log_w), zeros, raw
        if self.cfg.truncated_importance_sampling_ratio is None:
            return raw, zeros, raw
        weights, oob = truncated_importance_weights(
            log_w,
            token_mask,
            self.cfg.truncated_importance_sampling_type,
            self.cfg.truncated_importance_sampling_ratio,
            self.cfg.truncated_importance_sampling_ratio_min,
        )
        return weights, oob, raw
