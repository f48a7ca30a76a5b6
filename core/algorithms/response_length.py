"""DAPO's handling of over-long responses (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", section 3.4): ``grpo.overlong_filtering`` masks
truncated responses out of the loss, ``grpo.reward_shaping`` penalises responses by length
as they near the limit (eq. 13).

A response is *truncated* when it reached the longest allowed response (L_max: the
generation's max_new_tokens, as cut to fit ``max_total_sequence_length``) without a stop
token.  Its length counts every generated token, the stop token included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.algorithms.config import GRPOConfig


@dataclass(frozen=True)
class LengthShaping:
    """One step's rewards after the length rules, and which samples stay in the loss."""

    rewards: torch.Tensor  # [B] the environment's rewards plus the overlong penalty
    penalties: torch.Tensor  # [B] <= 0: the penalty added (0 without reward shaping)
    sample_mask: torch.Tensor  # [B] 1, or 0 for a truncated sample under overlong filtering
    truncated: torch.Tensor  # [B] bool

    def metrics(self, cfg: GRPOConfig) -> dict[str, float]:
        """Only the metrics of the rules that are on (the default run's metrics are unchanged)."""
        out: dict[str, float] = {}
        if cfg.overlong_filtering or cfg.reward_shaping.enabled:
            out["truncated_samples"] = float(self.truncated.sum())
        if cfg.overlong_filtering:
            out["overlong_filtered_samples"] = float((self.sample_mask == 0).sum())
        if cfg.reward_shaping.enabled:
            out["overlong_penalty_mean"] = float(self.penalties.mean())
            out["overlong_penalized_samples"] = float((self.penalties < 0).sum())
        return out


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), scaled by ``penalty``::

        R(|y|) = 0                                    |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               = -1                                   L_max < |y|

    with L_max = ``max_length`` and L_cache = ``buffer_length``; returns ``penalty * R`` [B]."""
    if not 0 < buffer_length < max_length:
        raise ValueError(f"overlong buffer length must be in (0, {max_length}), got {buffer_length}")
    excess = lengths.double() - (max_length - buffer_length)
    ramp = (-excess / buffer_length).clamp(min=-1.0, max=0.0)
    return (penalty * ramp).float()


def shape_response_lengths(
    rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, cfg: GRPOConfig, max_length: int
) -> LengthShaping:
    """``grpo.reward_shaping`` and ``grpo.overlong_filtering`` applied to one step's samples."""
    shaping = cfg.reward_shaping
    penalties = torch.zeros_like(rewards)
    if shaping.enabled:
        if shaping.overlong_buffer_length is None:  # GRPOConfig.check refuses it
            raise ValueError("grpo.reward_shaping.overlong_buffer_length is required when reward shaping is on")
        penalties = overlong_penalty(
            lengths, max_length, shaping.overlong_buffer_length, shaping.overlong_buffer_penalty
        )
    sample_mask = torch.ones_like(rewards)
    if cfg.overlong_filtering:
        sample_mask = (~truncated).float()
    return LengthShaping(rewards + penalties, penalties, sample_mask, truncated)
