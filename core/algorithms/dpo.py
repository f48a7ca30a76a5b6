"""DPO (NeMo RL's ``dpo_train``) on any training backend: ``dualrl dpo``.

One step = one optimizer step on ``policy.train_global_batch_size / 2`` preference pairs,
laid out as ``DPOLossFn`` expects: chosen at even rows, rejected at the odd row after it::

    pairs (BatchLoader) -> [c0, r0, c1, r1, ...]
      -> reference_policy_logprobs (frozen reference weights)   timing/reference_s
      -> policy.train(DPOLossFn)                                timing/train_s

Metrics: ``loss``, ``preference_loss``, ``sft_loss``, ``accuracy`` (share of pairs whose
chosen implicit reward beats the rejected one), ``rewards_chosen_mean`` /
``rewards_rejected_mean`` (the implicit rewards sum log pi - log pi_ref over a response,
before the beta factor) and ``reward_margin`` (their difference).  Validation computes the
same in eval mode on the held-out pairs; their reference log-probs never change and are
computed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from core.algorithms.config import DPORunConfig
from core.algorithms.run_setup import ModelResolver, load_tokenizer, seed_everything
from core.algorithms.sft import evaluate, held_out_prompts, sequence_batch, start_workers, step_throughput
from core.algorithms.timing import StepTimer
from core.algorithms.training_run import (
    TrainingRun,
    check_run_config,
    open_run,
    report_skipped_steps,
    train_loop,
    train_metrics,
)
from core.data import BatchedDataDict
from core.datasets import BatchLoader
from core.losses.config import DPOLossConfig


def preference_batch(pairs: Sequence[Any], pad_id: int) -> BatchedDataDict:
    """``PreferenceDatum``s as one batch, chosen at row 2i and rejected at row 2i + 1."""
    return sequence_batch([side for pair in pairs for side in (pair.chosen, pair.rejected)], pad_id)


def with_margin(metrics: dict[str, float]) -> dict[str, float]:
    if "rewards_chosen_mean" in metrics and "rewards_rejected_mean" in metrics:
        metrics["reward_margin"] = metrics["rewards_chosen_mean"] - metrics["rewards_rejected_mean"]
    return metrics


def reference_logprobs(run: TrainingRun, data: BatchedDataDict) -> torch.Tensor:
    run.policy.prepare_for_lp_inference()
    return run.policy.get_reference_policy_logprobs(data)["reference_logprobs"]


def dpo_step(run: TrainingRun, step: int) -> dict[str, float]:
    """One DPO step on ``run``; its metrics."""
    timer = StepTimer()
    data = preference_batch(run.loader.next_batch(), run.tokenizer.pad_token_id)
    with timer("reference"):
        data["reference_policy_logprobs"] = reference_logprobs(run, data)
    run.policy.prepare_for_training()
    with timer("train"):
        result = run.policy.train(data, run.loss_fn)
    run.policy.finish_training()
    report_skipped_steps(step, result)
    metrics = with_margin(train_metrics(result))
    metrics.update(timer.metrics())
    metrics.update(step_throughput(data, metrics["timing/train_s"]))
    return metrics


class _Validation:
    """The held-out pairs as one batch, with their (fixed) reference log-probs computed once."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.data: BatchedDataDict | None = None

    def __call__(self, step: int) -> dict[str, float]:
        if self.data is None:
            items = [self.run.val_dataset[i] for i in range(len(self.run.val_dataset))]
            data = preference_batch(items, self.run.tokenizer.pad_token_id)
            data["reference_policy_logprobs"] = reference_logprobs(self.run, data)
            self.data = data
        return with_margin(evaluate(self.run, self.data, "num_valid_samples"))


def dpo_loss(cfg: DPORunConfig):
    """``DPOLossFn`` from the loss keys of the ``dpo`` section (NeMo RL keeps them there)."""
    from core.losses import DPOLossFn

    return DPOLossFn(DPOLossConfig.coerce(cfg.dpo.model_dump(include=set(DPOLossConfig.model_fields))))


def setup_dpo(cfg: DPORunConfig | Mapping[str, Any], *, resolve: ModelResolver) -> TrainingRun:
    """Everything a DPO run needs, driver-side checks first, then the workers."""
    from core.datasets.supervised import build_preference_datasets

    cfg = check_run_config(cfg, "dpo")
    d = cfg.dpo
    seed_everything(d.seed)
    tokenizer = load_tokenizer(cfg.policy)
    max_length = cfg.policy.max_total_sequence_length
    train_set, val_set = build_preference_datasets(cfg.data, d, tokenizer, max_length=max_length)
    resolved = resolve(cfg, held_out_prompts(val_set))
    loader = BatchLoader(
        train_set,
        cfg.policy.train_global_batch_size // 2,
        shuffle=cfg.data.shuffle,
        seed=d.seed,
    )
    run = open_run(TrainingRun, "dpo", cfg, resolved, tokenizer, loader, val_set, dpo_loss(cfg))
    start_workers(run)
    return run


def dpo_train(run: TrainingRun) -> int:
    validate = _Validation(run) if len(run.val_dataset) else None
    return train_loop(run, lambda step: dpo_step(run, step), validate)
