"""SFT (NeMo RL's ``sft_train``) on any training backend: ``dualrl sft``.

One step = one optimizer step on ``policy.train_global_batch_size`` examples, each a token
sequence whose ``token_mask`` marks the response / assistant tokens (the only ones the
token-mean NLL trains on)::

    examples (BatchLoader) -> right-padded batch -> policy.train(NLLLoss)   timing/train_s

Validation runs the same loss in ``eval_mode`` over the held-out examples (``sft.val_batches``
batches of ``val_global_batch_size``) and reports the token-weighted mean.  Set-up, the loop,
checkpoints, resume, logging and the report are :mod:`core.algorithms.training_run`'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from core.algorithms.config import SFTConfig, SFTRunConfig
from core.algorithms.run_setup import ModelResolver, load_tokenizer, seed_everything
from core.algorithms.timing import StepTimer
from core.algorithms.training_run import (
    TrainingRun,
    check_run_config,
    open_run,
    report_skipped_steps,
    start_policy,
    train_loop,
    train_metrics,
)
from core.data import BatchedDataDict
from core.datasets import BatchLoader, EncodedDataset
from core.interfaces import TrainResult
from core.reporting import get_logger

logger = get_logger(__name__)


def sequence_batch(items: Sequence[Any], pad_id: int) -> BatchedDataDict:
    """``SequenceDatum``s as a right-padded training batch (``input_ids``, ``input_lengths``,
    ``token_mask``, ``sample_mask``), columns up to the longest sequence."""
    width = max(len(item.input_ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    token_mask = torch.zeros(len(items), width)
    for i, item in enumerate(items):
        ids[i, : len(item.input_ids)] = torch.tensor(item.input_ids)
        token_mask[i, : len(item.token_mask)] = torch.tensor(item.token_mask, dtype=torch.float32)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor([len(item.input_ids) for item in items]),
        token_mask=token_mask,
        sample_mask=torch.ones(len(items)),
    )


def padded_to_multiple(data: BatchedDataDict, multiple: int) -> BatchedDataDict:
    """``data`` with copies of its first row appended, masked out (``sample_mask`` and
    ``token_mask`` 0), up to a multiple of ``multiple`` rows: a last, partial validation
    batch then counts only its real rows."""
    extra = -data.size % multiple
    if not extra:
        return data
    filler = data.slice(0, 1).repeat_interleave(extra)
    filler["sample_mask"] = torch.zeros(extra)
    filler["token_mask"] = torch.zeros_like(filler["token_mask"])
    return BatchedDataDict.from_batches([data, filler], pad_value_dict={"input_ids": 0})


def weighted_metrics(result: TrainResult, weight_key: str) -> dict[str, float]:
    """``Policy.train`` (eval mode) metrics over several global batches, each batch weighted
    by ``weight_key`` (tokens for a token-mean loss, pairs for DPO): the mean the whole set
    would give in one batch."""
    per_step = {**result.metrics, "loss": result.loss}
    weights = per_step[weight_key]
    total = sum(weights)
    out = {k: sum(v * w for v, w in zip(values, weights, strict=True)) / total for k, values in per_step.items()}
    out[weight_key] = float(total)
    return out


def evaluate(run: TrainingRun, data: BatchedDataDict, weight_key: str) -> dict[str, float]:
    """The run's loss over ``data`` in eval mode (no optimizer step), batch-weighted."""
    section = supervised_section(run)
    gbs, mbs = section.val_global_batch_size, section.val_micro_batch_size
    run.policy.prepare_for_lp_inference()
    result = run.policy.train(padded_to_multiple(data, gbs), run.loss_fn, eval_mode=True, gbs=gbs, mbs=mbs)
    return weighted_metrics(result, weight_key)


def supervised_section(run: TrainingRun) -> SFTConfig:
    """The ``sft`` / ``dpo`` section of an SFT or DPO run (its validation batch sizes)."""
    section = run.section
    if not isinstance(section, SFTConfig):
        raise TypeError(f"a {run.algorithm} run has no SFT-style validation batches")
    return section


def step_throughput(data: BatchedDataDict, train_s: float) -> dict[str, float]:
    """Tokens of the step (padding excluded) and tokens per second of its train call."""
    tokens = float(data["input_lengths"].sum())
    return {
        "tokens": tokens,
        "response_tokens": float(data["token_mask"].sum()),
        "tokens_per_s": tokens / train_s if train_s > 0 else float("nan"),
    }


def sft_step(run: TrainingRun, step: int) -> dict[str, float]:
    """One SFT step on ``run``; its metrics."""
    timer = StepTimer()
    data = sequence_batch(run.loader.next_batch(), run.tokenizer.pad_token_id)
    run.policy.prepare_for_training()
    with timer("train"):
        result = run.policy.train(data, run.loss_fn)
    run.policy.finish_training()
    report_skipped_steps(step, result)
    metrics = train_metrics(result)
    metrics.update(timer.metrics())
    metrics.update(step_throughput(data, metrics["timing/train_s"]))
    return metrics


def sft_validate(run: TrainingRun, step: int) -> dict[str, float]:
    """Token-mean NLL over the held-out examples."""
    items = [run.val_dataset[i] for i in range(len(run.val_dataset))]
    return evaluate(run, sequence_batch(items, run.tokenizer.pad_token_id), "num_unmasked_tokens")


def check_val_batches(run: TrainingRun) -> None:
    """Validation batches must split over the data-parallel ranks like training batches."""
    section, dp = supervised_section(run), run.policy.data_parallel_size
    gbs, mbs = section.val_global_batch_size, section.val_micro_batch_size
    if section.val_batches and gbs % (dp * mbs):
        raise ValueError(
            f"{run.algorithm}.val_global_batch_size: {gbs} is not divisible by data-parallel size "
            f"{dp} x {run.algorithm}.val_micro_batch_size {mbs}"
        )


def setup_sft(
    cfg: SFTRunConfig | Mapping[str, Any],
    *,
    resolve: ModelResolver,
    exclude: frozenset[str] = frozenset(),
) -> TrainingRun:
    """Everything an SFT run needs, driver-side checks first, then the workers.  A built-in
    train stream never shows ``exclude`` (prompts a later stage holds out); ``resolve`` makes
    ``policy.model_name`` loadable."""
    from core.datasets.supervised import build_sft_datasets
    from core.losses import NLLLoss

    cfg = check_run_config(cfg, "sft")
    s = cfg.sft
    seed_everything(s.seed)
    tokenizer = load_tokenizer(cfg.policy)
    max_length = cfg.policy.max_total_sequence_length
    train_set, val_set = build_sft_datasets(cfg.data, s, tokenizer, max_length=max_length, exclude=exclude)
    resolved = resolve(cfg, held_out_prompts(val_set) | exclude)
    loader = BatchLoader(train_set, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=s.seed)
    run = open_run(TrainingRun, "sft", cfg, resolved, tokenizer, loader, val_set, NLLLoss())
    start_workers(run)
    return run


def held_out_prompts(val_set: EncodedDataset) -> frozenset[str]:
    """Prompt texts of a validation set (the built-in model's warm start must not see them)."""
    return frozenset(val_set[i].metadata.get("raw_prompt") for i in range(len(val_set))) - {None}


def start_workers(run: TrainingRun) -> None:
    """The policy (SFT and DPO need nothing else), closing the run if it fails."""
    try:
        start = time.perf_counter()
        cluster = start_policy(run)
        check_val_batches(run)
        logger.info(
            "workers up in %.1f s: %s policy on %d slot(s)",
            time.perf_counter() - start,
            run.cfg.policy.backend,
            cluster.world_size(),
        )
    except BaseException:
        run.close(failed=True)
        raise


def sft_train(run: TrainingRun) -> int:
    validate = (lambda step: sft_validate(run, step)) if len(run.val_dataset) else None
    return train_loop(run, lambda step: sft_step(run, step), validate)
