"""``PolicyWorkerBase``: what every backend's policy worker does the same way.

Construction arguments (the seeds' worker signature), the sampling temperature both
``get_logprobs`` and ``train`` apply, the tokenizer copy saved with checkpoints, the reference
logprobs, the step's one host read and the shape of ``train``'s result, the profile
directory and the liveness probe.  Engine-specific work stays in the backends.

Both workers' ``train`` has the same shape, helper for helper:

* ``train`` -- checks, then one ``_train_global_batch`` per global batch in the data (the
  global-batch loop), then the learning-rate schedule; ``_train_steps_result`` assembles
  the result from the steps' :class:`StepResult` values;
* ``_train_global_batch`` -- the global counts, ``_run_micro_batches`` (the micro-batch loop:
  forward and backward of each micro batch, metrics kept on the device),
  ``_optimizer_step`` (apply or skip the step) and ``_read_step`` (the step's one host read).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from core.interfaces import TrainResult
from core.losses.metrics import MicroBatchMetrics, read_once, whole_batch_metrics
from core.policy.checks import check_loss_fn, check_model_inputs, check_sequence_lengths, check_train_batch
from core.policy.config import PolicyConfig
from core.refit.sender import RefitSender

if TYPE_CHECKING:
    from core.data import BatchedDataDict

REFERENCE_MISSING = "this policy was built with init_reference_model=False: no reference weights"
OPTIMIZER_MISSING = "train() needs an optimizer: this policy was built with init_optimizer=False"
#: With policy.lora, the HF export's subdirectory holding the PEFT adapter (not the export
#: directory itself: transformers would then load the adapter on top of the merged weights).
LORA_ADAPTER_DIR = "lora_adapter"


_Train = TypeVar("_Train", bound=Callable[..., TrainResult])


def reports_worker_seconds(train: _Train) -> _Train:
    """Decorates a worker's ``train``: its result carries the seconds the call took on this
    rank (``TrainResult.worker_s``), from which the driver tells compute from dispatch."""

    @functools.wraps(train)
    def timed(*args: Any, **kwargs: Any) -> TrainResult:
        start = time.perf_counter()
        result = train(*args, **kwargs)
        return replace(result, worker_s=time.perf_counter() - start)

    return timed  # type: ignore[return-value]  # same signature: functools.wraps


class StepResult(NamedTuple):
    """One optimizer step of ``train``, as read on the host (``_train_global_batch``'s result)."""

    loss: float
    grad_norm: float
    metrics: dict[str, float]  # whole-batch value of every loss metric
    skip_reason: str | None  # None: the step was applied; else a core.interfaces.SKIP_REASONS key
    mb_metrics: dict[str, list[float]]  # this rank's per-micro-batch values ({}: another rank reports them)


class PolicyWorkerBase(RefitSender):
    """Base of ``TorchPolicyWorker`` and ``JaxPolicyWorker``; the refit methods come from
    ``RefitSender`` on top of each backend's ``iter_full_weights``."""

    rank: int = 0

    if TYPE_CHECKING:  # what every backend's worker defines (used by the shared methods below)

        def use_reference_model(self) -> contextlib.AbstractContextManager[None]: ...

        def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict: ...

    def __init__(self, config: PolicyConfig | Mapping[str, Any], tokenizer: Any = None) -> None:
        self.cfg = PolicyConfig.coerce(config, path="policy")
        self.tokenizer = tokenizer
        # The distribution generation samples from: applied identically by get_logprobs and train.
        self.temperature = self.cfg.generation.temperature if self.cfg.generation is not None else 1.0

    def is_alive(self) -> bool:
        return True

    # The driver's checks again, for a caller that went past it; callers run these inside
    # ``before_collectives()`` so that a failure here leaves the group usable.
    def _check_batch(self, data: Mapping[str, Any], vocab_size: int) -> None:
        """``get_logprobs`` / ``generate`` input: lengths within the limit, ids and masks valid."""
        check_sequence_lengths(data, self.cfg.max_total_sequence_length)
        check_model_inputs(data, vocab_size)

    def _check_train_call(
        self,
        data: Mapping[str, Any],
        loss_fn: Any,
        gbs: int,
        mbs: int,
        dp: int,
        vocab_size: int,
        eval_mode: bool,
        has_optimizer: bool,
    ) -> int:
        """``train`` input; returns this rank's rows per global batch."""
        local_gbs = check_train_batch(data, gbs, mbs, dp, self.cfg.max_total_sequence_length)
        check_model_inputs(data, vocab_size)
        check_loss_fn(loss_fn)
        if not eval_mode and not has_optimizer:
            raise RuntimeError(OPTIMIZER_MISSING)
        return local_gbs

    def get_reference_policy_logprobs(self, data: Any, micro_batch_size: int | None = None) -> Any:
        """``get_logprobs`` under the reference weights (``use_reference_model``), as
        ``{"reference_logprobs": [B, S]}``."""
        from core.data import BatchedDataDict

        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    def get_logprobs_and_reference(self, data: Any, micro_batch_size: int | None = None) -> Any:
        """``get_logprobs`` then ``get_reference_policy_logprobs`` in one call: one dispatch
        from the driver, each pass over the batch once; ``{"logprobs", "reference_logprobs"}``."""
        out = self.get_logprobs(data, micro_batch_size)
        out["reference_logprobs"] = self.get_reference_policy_logprobs(data, micro_batch_size)["reference_logprobs"]
        return out

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        pass  # nothing to release: training state stays resident until offloaded

    @staticmethod
    def _profile_root() -> Path:
        """Where profiler traces go: ``$DUALRL_PROFILE_DIR`` (default ``./profiles``), absolute."""
        return Path(os.environ.get("DUALRL_PROFILE_DIR", "profiles")).resolve()

    def _peft_config(self) -> dict[str, Any]:
        """``adapter_config.json`` of this policy's adapters (``policy.lora``)."""
        from core.models.lora import peft_adapter_config

        lora = self.cfg.lora
        return peft_adapter_config(
            self.cfg.model_name, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.use_rslora
        )

    def _save_tokenizer(self, tokenizer_path: str | None) -> None:
        """Rank 0 writes the tokenizer files next to a checkpoint."""
        if tokenizer_path is not None and self.rank == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(tokenizer_path)

    @staticmethod
    def _read_step(
        collected: MicroBatchMetrics, totals: Any, table: Any, *extra: Any
    ) -> tuple[dict[str, float], dict[str, list[float]], list[list[float]]]:
        """The step's one host read (``core.losses.metrics.read_once``): ``totals`` [keys] and
        ``table`` [micro batches, keys] of ``collected``, together with ``extra`` arrays (counts,
        gradient norm, skip flag).  Returns the whole-batch metrics, the per-micro-batch
        metrics and each extra array's values."""
        total_values, mb_values, *extra_values = read_once(totals, table, *extra)
        metrics = whole_batch_metrics(dict(zip(collected.keys, total_values, strict=True)))
        return metrics, collected.per_micro_batch(mb_values), extra_values

    @staticmethod
    def _train_steps_result(results: Sequence[StepResult], lr: float | None) -> TrainResult:
        """``train``'s return value from its steps, in order (this rank's micro batches)."""
        all_mb: dict[str, list[float]] = {}
        for r in results:
            for k, values in r.mb_metrics.items():
                all_mb.setdefault(k, []).extend(values)
        keys = sorted(results[0].metrics) if results else []
        return TrainResult(
            loss=[r.loss for r in results],
            grad_norm=[r.grad_norm for r in results],
            metrics={k: [r.metrics[k] for r in results] for k in keys},
            skip_reasons=[r.skip_reason for r in results],
            lr=lr,
            all_mb_metrics=all_mb,
        )


def step_skip_reason(global_seqs: float, global_toks: float, loss: float, grad_norm: float) -> str | None:
    """Whether an optimizer step must be skipped, from *globally reduced* values (so every
    rank decides the same): no valid sequence / token in the global batch, a non-finite
    global loss, or a non-finite global gradient norm.  None: apply the step; else the
    ``core.interfaces.SKIP_REASONS`` key."""
    import math

    if not (global_seqs > 0 and global_toks > 0):
        return "no_valid_tokens"
    if not math.isfinite(loss):
        return "non_finite_loss"
    if not math.isfinite(grad_norm):
        return "non_finite_grad_norm"
    return None
