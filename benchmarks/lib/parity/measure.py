"""What is measured on each layout: logprobs, batch invariance, NLL steps and the step after a load."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.lib.parity.estimators import estimator_rows_policy
from benchmarks.lib.parity.grpo import grpo_policy
from benchmarks.lib.parity.multi_turn import multi_turn_policy
from benchmarks.lib.parity.settings import GRPO_STEPS


def _inputs(ids, lengths):
    from core.data import BatchedDataDict

    return BatchedDataDict(input_ids=ids.contiguous(), input_lengths=lengths.contiguous())


def max_abs_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def batch_invariance(logprobs: Callable, data, other, full) -> dict[str, float]:
    """Largest deviation per variant of a row's logprobs from the same row in ``full``, the
    logprobs of the whole batch on the same weights (``logprobs(ids, lengths) -> [b, s]``)."""
    import torch

    ids, lengths = data["input_ids"], data["input_lengths"]
    rows = len(ids)
    dev = {}
    # A batch of one at the same width: the longest row and the last one.
    dev["alone"] = max(max_abs_diff(logprobs(ids[r : r + 1], lengths[r : r + 1])[0], full[r]) for r in {0, rows - 1})
    # A batch of only the shortest row is only as wide as that row (the width is a batch property).
    r = int(torch.argmin(lengths))
    n = int(lengths[r])
    dev["alone_trimmed"] = max_abs_diff(logprobs(ids[r : r + 1, :n], lengths[r : r + 1])[0], full[r, :n])
    order = torch.arange(rows).flip(0)
    dev["reversed"] = max_abs_diff(logprobs(ids[order], lengths[order]).flip(0), full)
    # Rows 0..h-1 at the even positions, companions from another batch at the odd ones: on a
    # dp=2 layout this changes both the rank a row lands on and its micro-batch neighbours.
    h = max(1, rows // 2)
    mixed_ids = torch.stack([t for pair in zip(ids[:h], other["input_ids"][:h], strict=True) for t in pair])
    mixed_len = torch.stack([t for pair in zip(lengths[:h], other["input_lengths"][:h], strict=True) for t in pair])
    dev["mixed"] = max_abs_diff(logprobs(mixed_ids, mixed_len)[0::2], full[:h])
    return dev


def train_steps(step: Callable, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` calls of ``step() -> (loss, grad_norm)``; the losses and norms."""
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = step()
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def measure(logprobs: Callable, step: Callable, data, other, steps: int, grpo: Callable | None = None) -> dict:
    """Initial logprobs, batch invariance, GRPO step 0 and the fused step (``grpo() -> {name:
    summary}``, if given), ``steps`` NLL training steps, trained logprobs -- in this order, so
    the first three see the initial weights (and GRPO step 0 a fresh optimizer)."""
    initial = logprobs(data["input_ids"], data["input_lengths"])
    out = {"logprobs": initial, "invariance": batch_invariance(logprobs, data, other, initial)}
    if grpo is not None:  # {"grpo": ..., "grpo_fused": ...[, "grpo_fused_separate": ...], multi-turn, estimators}
        t0 = time.perf_counter()
        out.update(grpo())
        out["grpo_s"] = time.perf_counter() - t0
    out["loss"], out["grad_norm"] = train_steps(step, steps)
    out["trained_logprobs"] = logprobs(data["input_ids"], data["input_lengths"])
    return out


def policy_logprobs(policy, ids, lengths):
    return policy.get_logprobs(_inputs(ids, lengths))["logprobs"]


def nll_step(runner, data) -> tuple[float, float]:
    """One ``policy.train`` call of ``NLLLoss`` with the runner's gbs/mbs; (loss, grad norm)."""
    from core.losses import NLLLoss

    out = runner.policy.train(data, NLLLoss(), gbs=runner.gbs, mbs=runner.mbs)
    return out.loss[0], out.grad_norm[0]


def measure_policy(
    runner, data, other, steps: int, grpo_base=None, grpo_steps: int = GRPO_STEPS, multi_turn=None
) -> dict:
    """:func:`measure` on a runner's Policy: ``NLLLoss``, the runner's gbs/mbs (one micro batch
    per data-parallel rank, one optimizer step per ``train`` call); GRPO on ``grpo_base``, then
    (given a ``MultiTurnWorkload``) the multi-turn GRPO step, then the estimator rows."""
    policy = runner.policy

    def grpo() -> dict:
        out = grpo_policy(runner, grpo_base, grpo_steps)
        if multi_turn is not None:
            out.update(multi_turn_policy(runner, multi_turn, grpo_steps))
        out.update(estimator_rows_policy(runner, grpo_base, grpo_steps))
        return out

    return measure(
        lambda ids, lengths: policy_logprobs(policy, ids, lengths),
        lambda: nll_step(runner, data),
        data,
        other,
        steps,
        None if grpo_base is None else grpo,
    )


def after_one_more_step(runner, data) -> dict:
    """``dcp_resume``'s measurement: one more NLL step, then the logprobs of the batch."""
    loss, norm = nll_step(runner, data)
    return {
        "loss": loss,
        "grad_norm": norm,
        "logprobs": policy_logprobs(runner.policy, data["input_ids"], data["input_lengths"]),
    }
