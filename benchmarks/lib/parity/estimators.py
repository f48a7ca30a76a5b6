"""The estimator rows of a parity run (``settings.ESTIMATOR_ROWS``: ``grpo_dr_grpo_step``,
``grpo_rloo_step``): after the multi-turn step, one GRPO ``train`` call per row on every
layout and on ``hf``, with a registered advantage estimator's advantages and its loss.

The batch is GRPO step 0's (``grpo.grpo_batch``) with seeded rewards per row, in groups of
consecutive rows (:func:`group_size`), turned into advantages by
``core.algorithms.advantages.compute_advantages`` (the switches the estimator implies), and the
last row's ``sample_mask`` at 0, as ``grpo.overlong_filtering`` leaves a truncated sample: it
must leave the valid-sequence and valid-token counts, which each backend gathers over its
ranks and micro batches -- and which Dr. GRPO's constant normaliser (valid sequences x
``constant_token_budget``) divides by.  The budget is the batch's width, the longest response
a row could have (``dualrl grpo`` fills in the longest response it generates).
"""

from __future__ import annotations

import math

from benchmarks.lib.parity.grpo import grpo_loss_fn, grpo_step0_policy
from benchmarks.lib.parity.settings import ESTIMATOR_GROUP_SIZE, ESTIMATOR_ROWS, ESTIMATOR_SEED, GRPO_STEPS


def group_size(rows: int) -> int:
    """The rows' gcd with ``ESTIMATOR_GROUP_SIZE``, or all of them in one group where that is 1
    (RLOO's leave-one-out baseline needs two samples; ``check_arguments`` refuses a batch of 1)."""
    size = math.gcd(rows, ESTIMATOR_GROUP_SIZE)
    return size if size > 1 else rows


def estimator_batch(base, estimator: str, seed: int = ESTIMATOR_SEED):
    """``base`` (a ``grpo_batch``) with ``estimator``'s advantages of seeded rewards and its
    last sample masked out."""
    import torch

    from core.algorithms.advantages import ESTIMATORS, compute_advantages
    from core.data import BatchedDataDict

    mask, rows = base["token_mask"], len(base["input_ids"])
    sample_mask = base["sample_mask"].clone()
    sample_mask[-1] = 0.0
    rewards = torch.rand(rows, generator=torch.Generator().manual_seed(seed))
    implied = ESTIMATORS[estimator].implies  # the rows' estimators set both switches
    advantages = compute_advantages(
        rewards,
        group_size(rows),
        estimator=estimator,
        leave_one_out=bool(implied["grpo.use_leave_one_out_baseline"]),
        normalize=bool(implied["grpo.normalize_rewards"]),
        token_counts=mask.sum(1) * sample_mask,
    ).advantages
    return BatchedDataDict({**base, "sample_mask": sample_mask, "advantages": advantages[:, None] * mask})


def estimator_loss_fn(overrides: dict, width: int):
    """The row's ``ClippedPGLossFn``; a constant normaliser's budget: ``width`` tokens."""
    if overrides.get("token_normalizer") == "constant":
        overrides = {"constant_token_budget": width, **overrides}
    return grpo_loss_fn(overrides=overrides)


def estimator_rows_policy(runner, base, steps: int = GRPO_STEPS) -> dict:
    """``{measurement key: grpo_summary}`` of every estimator row on a layout (as item 7:
    old and reference log-probs from the policy, one ``train`` call of ``steps`` optimizer steps)."""
    width = base["input_ids"].shape[1]
    return {
        key: grpo_step0_policy(runner, estimator_batch(base, estimator), steps, estimator_loss_fn(overrides, width))
        for key, estimator, overrides in ESTIMATOR_ROWS.values()
    }


def estimator_rows_hf(hf, base, steps: int = GRPO_STEPS) -> dict:
    """:func:`estimator_rows_policy` on the HF reference (reference log-probs: its initial model)."""
    width = base["input_ids"].shape[1]
    out = {}
    for key, estimator, overrides in ESTIMATOR_ROWS.values():
        data = dict(estimator_batch(base, estimator))
        data["prev_logprobs"] = hf.logprobs(data["input_ids"], data["input_lengths"])
        data["reference_policy_logprobs"] = hf.reference_logprobs(data["input_ids"], data["input_lengths"])
        out[key] = hf.grpo_steps(data, estimator_loss_fn(overrides, width), steps)
    return out
