"""GRPO advantages: each sample's reward against the other samples of its prompt's group.

Rows are laid out group by group (``num_generations_per_prompt`` consecutive rows share a
prompt), which is how the loop builds rollouts, so groups are a reshape, not a search.

Conventions follow NeMo RL's ``calculate_baseline_and_std_per_prompt``:

* baseline: the group's mean reward, or with ``leave_one_out`` the mean of the *other*
  samples (an unbiased baseline: a sample's own reward does not pull its baseline);
* std: the population std over the same samples the baseline averages;
* ``normalize``: advantages are divided by that std where it is > 0.  A std of 0 leaves
  the advantage as ``reward - baseline``: dividing by a tiny epsilon would blow a
  near-tie up into a huge step.

A zero-variance group (all samples scored alike) gets advantage 0 everywhere, so it
contributes nothing but the KL term; its share is reported as a metric because a run
where most groups are all-right or all-wrong has stopped learning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] float32, one per sample
    baseline: torch.Tensor  # [B]
    std: torch.Tensor  # [B]
    zero_variance_groups: int
    num_groups: int

    def metrics(self) -> dict[str, float]:
        return {
            "advantage_abs_mean": float(self.advantages.abs().mean()),
            "baseline_mean": float(self.baseline.mean()),
            "reward_group_std_mean": float(self.std.mean()),
            "zero_variance_group_fraction": self.zero_variance_groups / max(self.num_groups, 1),
        }


def group_baseline_and_std(
    rewards: torch.Tensor, group_size: int, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std of ``rewards`` [B] over its group (see the module docstring)."""
    groups = _as_groups(rewards, group_size).double()
    if leave_one_out and group_size < 2:
        raise ValueError("a leave-one-out baseline needs at least 2 samples per group")
    total, total_sq = groups.sum(1, keepdim=True), groups.square().sum(1, keepdim=True)
    if leave_one_out:
        count = group_size - 1
        mean = (total - groups) / count
        mean_sq = (total_sq - groups.square()) / count
    else:
        mean = (total / group_size).expand_as(groups)
        mean_sq = (total_sq / group_size).expand_as(groups)
    # Clamp: the two sums cancel to a tiny negative number for equal rewards.
    std = (mean_sq - mean.square()).clamp_min(0.0).sqrt()
    return mean.reshape(-1).float(), std.reshape(-1).float()


def compute_advantages(rewards: torch.Tensor, group_size: int, *, leave_one_out: bool, normalize: bool) -> Advantages:
    """GRPO advantages of ``rewards`` [B] (B a multiple of ``group_size``), one per sample."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        bad = int(torch.nonzero(~torch.isfinite(rewards))[0])
        raise ValueError(f"reward of sample {bad} is {float(rewards[bad])}: advantages need finite rewards")
    baseline, std = group_baseline_and_std(rewards, group_size, leave_one_out)
    advantages = rewards - baseline
    if normalize:
        spread = std > 0
        advantages = torch.where(spread, advantages / torch.where(spread, std, 1.0), advantages)
    groups = _as_groups(rewards, group_size)
    zero_var = int((groups.max(1).values == groups.min(1).values).sum())
    # Exact zeros for tied groups (the leave-one-out arithmetic leaves ~1e-8 residues).
    tied = (groups.max(1, keepdim=True).values == groups.min(1, keepdim=True).values).expand_as(groups).reshape(-1)
    advantages = torch.where(tied, 0.0, advantages)
    return Advantages(advantages.float(), baseline, std, zero_var, groups.shape[0])


def _as_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)
