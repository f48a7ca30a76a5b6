"""Advantages: each sample's reward turned into how much better it was than expected.

Rows are laid out group by group (``num_generations_per_prompt`` consecutive rows share a
prompt), which is how the loop builds rollouts, so groups are a reshape, not a search.

``grpo.advantage_estimator`` picks one of :data:`ESTIMATORS`, the one registry of estimators:
each entry is its advantage function (the formulas and papers are in their docstrings) and the
settings it implies, which the run config fills in where the file leaves them out and refuses
where an explicit value contradicts them (``core.algorithms.config``).  Adding an estimator is
one entry here.  The group statistics follow NeMo RL's ``calculate_baseline_and_std_per_prompt``:

* baseline: the group's mean reward, or with ``leave_one_out`` the mean of the *other*
  samples (an unbiased baseline: a sample's own reward does not pull its baseline);
* std: the population std over the same samples the baseline averages;
* ``normalize``: advantages are divided by that std where it is > 0.  A std of 0 leaves
  the advantage as ``reward - baseline``: dividing by a tiny epsilon would blow a
  near-tie up into a huge step.

With a group baseline (grpo, rloo, dr_grpo) a zero-variance group (all samples scored alike)
gets advantage 0 everywhere, so it contributes nothing but the KL term; its share is reported
as a metric because a run where most groups are all-right or all-wrong has stopped learning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it computes: the run config reads ESTIMATORS without it
    import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] float32, one per sample
    baseline: torch.Tensor  # [B] what was subtracted from each reward before any batch whitening
    std: torch.Tensor  # [B] the group's reward std (over the samples the baseline averages)
    zero_variance_groups: int
    num_groups: int

    def metrics(self) -> dict[str, float]:
        return {
            "advantage_abs_mean": float(self.advantages.abs().mean()),
            "baseline_mean": float(self.baseline.mean()),
            "reward_group_std_mean": float(self.std.mean()),
            "zero_variance_group_fraction": self.zero_variance_groups / max(self.num_groups, 1),
        }


@dataclass(frozen=True)
class EstimatorInput:
    """What an estimator reads: one step's rewards and how much each sample weighs."""

    rewards: torch.Tensor  # [B] float32, finite, a whole number of groups
    group_size: int
    token_counts: torch.Tensor  # [B] the tokens each sample has in the loss (0: masked out)
    leave_one_out: bool  # grpo's use_leave_one_out_baseline (implied by the others)
    normalize: bool  # grpo's normalize_rewards (implied by the others)


#: (advantages [B], baseline [B], group std [B]) of one estimator.
Estimate = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]


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


# ----------------------------------------------------------------------------- estimators
def grpo_advantages(x: EstimatorInput) -> Estimate:
    """GRPO (Shao et al. 2024, "DeepSeekMath", outcome supervision)::

        A_i = (r_i - mean(r_group)) / std(r_group)

    ``normalize: false`` drops the division; ``leave_one_out`` takes mean and std over the
    group's *other* samples (NeMo RL's ``use_leave_one_out_baseline``).  Tied groups: 0."""
    import torch

    baseline, std = group_baseline_and_std(x.rewards, x.group_size, x.leave_one_out)
    advantages = x.rewards - baseline
    if x.normalize:
        spread = std > 0
        advantages = torch.where(spread, advantages / torch.where(spread, std, 1.0), advantages)
    return _zero_tied_groups(advantages, x.rewards, x.group_size), baseline, std


def rloo_advantages(x: EstimatorInput) -> Estimate:
    """RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs")::

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j

    the leave-one-out baseline, no std normalisation."""
    baseline, std = group_baseline_and_std(x.rewards, x.group_size, leave_one_out=True)
    return _zero_tied_groups(x.rewards - baseline, x.rewards, x.group_size), baseline, std


def reinforce_plus_plus_advantages(x: EstimatorInput) -> Estimate:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"), outcome reward, KL in the loss::

        A_i = (r_i - mu_B) / sigma_B

    with mu_B, sigma_B the mean and (population) std over every valid *token* of the batch
    (each sample weighs its token count), as verl's and OpenRLHF's ``reinforce_plus_plus``
    whiten; no group baseline, so a tied group keeps a non-zero advantage."""
    import torch

    baseline = torch.zeros_like(x.rewards)
    _, std = group_baseline_and_std(x.rewards, x.group_size, leave_one_out=False)
    return _whiten(x.rewards, x.token_counts), baseline, std


def reinforce_plus_plus_baseline_advantages(x: EstimatorInput) -> Estimate:
    """REINFORCE++-baseline (Hu 2025, the group-baseline variant; verl's
    ``reinforce_plus_plus_baseline``, OpenRLHF's ``reinforce_baseline``)::

        a_i = r_i - mean(r_group);   A_i = (a_i - mu_B) / sigma_B

    mu_B, sigma_B over the batch's valid tokens as in :func:`reinforce_plus_plus_advantages`."""
    baseline, std = group_baseline_and_std(x.rewards, x.group_size, leave_one_out=False)
    return _whiten(x.rewards - baseline, x.token_counts), baseline, std


def dr_grpo_advantages(x: EstimatorInput) -> Estimate:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective")::

        A_i = r_i - mean(r_group)

    no std division (it weighs too-easy and too-hard prompts up); the other half of the fix,
    a loss summed over tokens and divided by a constant, is ``loss_fn.token_normalizer:
    constant`` (the config requires it)."""
    baseline, std = group_baseline_and_std(x.rewards, x.group_size, leave_one_out=False)
    return _zero_tied_groups(x.rewards - baseline, x.rewards, x.group_size), baseline, std


@dataclass(frozen=True)
class AdvantageEstimator:
    """One ``grpo.advantage_estimator``: its advantages and the run settings it implies."""

    compute: Callable[[EstimatorInput], Estimate]
    """Rewards -> (advantages, baseline, group std)."""
    implies: Mapping[str, Any] = field(default_factory=dict)
    """Run-config keys (``section.key``) -> the value the estimator needs: filled in where the
    config leaves the key out, refused naming the estimator where it sets another value."""
    why: str = ""
    """Why it implies them (said in the refusal)."""


_NO_GROUP_STD = {"grpo.normalize_rewards": False, "grpo.use_leave_one_out_baseline": False}

#: ``grpo.advantage_estimator`` -> its estimator: the one registry (config, loop and parity read it).
ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(grpo_advantages),
    "rloo": AdvantageEstimator(
        rloo_advantages,
        {"grpo.normalize_rewards": False, "grpo.use_leave_one_out_baseline": True},
        "RLOO's baseline is the mean of the other samples, and it does not divide by a std",
    ),
    "reinforce_plus_plus": AdvantageEstimator(
        reinforce_plus_plus_advantages,
        _NO_GROUP_STD,
        "REINFORCE++ has no group baseline and normalises by the whole batch's std itself",
    ),
    "reinforce_plus_plus_baseline": AdvantageEstimator(
        reinforce_plus_plus_baseline_advantages,
        _NO_GROUP_STD,
        "REINFORCE++-baseline subtracts the group mean, then normalises by the whole batch's std itself",
    ),
    "dr_grpo": AdvantageEstimator(
        dr_grpo_advantages,
        {**_NO_GROUP_STD, "loss_fn.token_level_loss": True, "loss_fn.token_normalizer": "constant"},
        "Dr. GRPO subtracts the group mean and divides by no std, and sums each response's token losses over a "
        "constant token budget, with no length normaliser (its point: no difficulty or length bias)",
    ),
}


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    estimator: str,
    leave_one_out: bool,
    normalize: bool,
    token_counts: torch.Tensor | None = None,
) -> Advantages:
    """Advantages of ``rewards`` [B] (B a multiple of ``group_size``), one per sample.

    ``token_counts`` [B] weigh the batch statistics of the REINFORCE++ estimators (None:
    every sample weighs 1); a sample with 0 tokens (masked out of the loss) does not count."""
    import torch

    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        bad = int(torch.nonzero(~torch.isfinite(rewards))[0])
        raise ValueError(f"reward of sample {bad} is {float(rewards[bad])}: advantages need finite rewards")
    _check_switches(estimator, leave_one_out=leave_one_out, normalize=normalize)
    groups = _as_groups(rewards, group_size)
    counts = torch.ones_like(rewards) if token_counts is None else torch.as_tensor(token_counts).float()
    x = EstimatorInput(rewards, group_size, counts, leave_one_out, normalize)
    advantages, baseline, std = ESTIMATORS[estimator].compute(x)
    zero_var = int((groups.max(1).values == groups.min(1).values).sum())
    return Advantages(advantages.float(), baseline, std, zero_var, groups.shape[0])


# ----------------------------------------------------------------------------- helpers
def _check_switches(estimator: str, *, leave_one_out: bool, normalize: bool) -> None:
    """The estimator exists and the switches agree with it (GRPOConfig.check's rule)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
    given = {"grpo.normalize_rewards": normalize, "grpo.use_leave_one_out_baseline": leave_one_out}
    for key, needed in ESTIMATORS[estimator].implies.items():
        if key in given and given[key] != needed:
            raise ValueError(f"advantage estimator {estimator!r} needs {key}={needed}, got {given[key]}")


def _zero_tied_groups(advantages: torch.Tensor, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Exact zeros for tied groups (the leave-one-out arithmetic leaves ~1e-8 residues)."""
    import torch

    groups = _as_groups(rewards, group_size)
    tied = (groups.max(1, keepdim=True).values == groups.min(1, keepdim=True).values).expand_as(groups)
    return torch.where(tied.reshape(-1), 0.0, advantages)


def _whiten(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(values - mu) / sigma with the ``weights``-weighted mean and population std (a sigma of
    0 leaves values - mu, as the group std does above; no weight at all leaves values as they are)."""
    v, w = values.double(), weights.double()
    total = w.sum()
    if total <= 0:
        return values
    mean = (w * v).sum() / total
    std = ((w * (v - mean).square()).sum() / total).sqrt()
    return ((v - mean) / (std if std > 0 else 1.0)).float()


def _as_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)
