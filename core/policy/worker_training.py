"""The ``train`` skeleton every backend's worker runs, with the engine's hooks.

``train`` checks its input before any collective, lets the engine prepare the call
(``_train_call``: mode switches, host -> device conversion, compiled steps, the learning rate),
runs one ``_train_global_batch`` per global batch, advances the schedule once if a step was
applied, and assembles the :class:`TrainResult`.  ``_train_global_batch`` is one optimizer
step:

1. the global batch's valid sequences and tokens, summed over the data-parallel ranks
   (``_global_valid_counts``);
2. forward and backward of every micro batch (``_run_micro_batches``), metrics kept on the
   device;
3. the metrics table summed over micro batches (and ranks: ``_sum_over_dp``);
4. the optimizer step queued (``_queue_optimizer_step``: torch measures the gradient norm, JAX
   queues its jitted update, which decides on the device whether to apply it);
5. the step's one host read (``_read_step``), then the step applied or skipped on the host
   where the engine decides there (``_finish_optimizer_step``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from core.distributed.recoverable import before_collectives
from core.interfaces import LossFunction, TrainResult
from core.losses.metrics import MicroBatchMetrics, read_once, whole_batch_metrics

if TYPE_CHECKING:
    from core.data import BatchedDataDict
    from core.policy.config import PolicyConfig

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


@dataclass
class TrainCall:
    """One ``train`` call as the engine prepared it (``_train_call``); an engine's subclass adds
    what its micro-batch loop needs (a compiled step, a shape bucket)."""

    loss_fn: LossFunction
    mbs: int
    eval_mode: bool
    global_batches: Sequence[Any]  # this rank's rows of each global batch, in the engine's form


CallT = TypeVar("CallT", bound=TrainCall)


def step_skip_reason(global_seqs: float, global_toks: float, loss: float, grad_norm: float) -> str | None:
    """Whether an optimizer step must be skipped, from *globally reduced* values (so every
    rank decides the same): no valid sequence / token in the global batch, a non-finite
    global loss, or a non-finite global gradient norm.  None: apply the step; else the
    ``core.interfaces.SKIP_REASONS`` key."""
    if not (global_seqs > 0 and global_toks > 0):
        return "no_valid_tokens"
    if not math.isfinite(loss):
        return "non_finite_loss"
    if not math.isfinite(grad_norm):
        return "non_finite_grad_norm"
    return None


class WorkerTraining(abc.ABC, Generic[CallT]):
    """``train`` and ``_train_global_batch``, written once (mixed into ``PolicyWorkerBase``)."""

    cfg: PolicyConfig

    @reports_worker_seconds
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """Optimizer steps over this rank's shard of one or more global batches.

        ``data`` holds ``n * gbs / dp`` rows (``n`` global batches, as sharded by the Policy);
        each global batch is one optimizer step.  A step whose global batch has no valid token,
        or whose global loss or gradient norm is not finite, is skipped on every rank (weights
        and optimizer state unchanged; see ``step_skip_reason``).  The learning-rate schedule
        advances once per call if at least one step was applied (a skipped step does not
        advance it, as in Megatron).  Returns rank-identical global values per step (loss, grad
        norm, skip reason, metrics summed over micro batches and ranks) plus this rank's
        per-micro-batch metrics in ``all_mb_metrics``.
        """
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        with before_collectives():
            local_gbs, rows = self._check_train_call(data, loss_fn, gbs, mbs, eval_mode)
        with self._train_call(data, loss_fn, local_gbs, rows, eval_mode) as call:
            results = [self._train_global_batch(call, gb) for gb in call.global_batches]
        if not eval_mode and any(r.skip_reason is None for r in results):
            self._advance_schedule()
        return self._train_steps_result(results, self._learning_rate())

    def _train_global_batch(self, call: CallT, gb: Any) -> StepResult:
        """Forward/backward every micro batch of one global batch, then one optimizer step
        unless its global counts, loss or gradient norm say to skip it.  The step's values are
        read on the host once, after the optimizer step is queued: nothing before waits for
        the device."""
        gseq, gtok = self._global_valid_counts(gb)
        grads, collected = self._run_micro_batches(call, gb, gseq, gtok)
        table = collected.table(self._device_scalar())
        totals = self._sum_over_dp(table.sum(0))
        queued = [] if call.eval_mode else self._queue_optimizer_step(grads, collected.keys, totals, gseq, gtok)
        metrics, mb_metrics, read = self._read_step(collected, totals, table, *queued)
        loss = metrics.get("loss", 0.0)
        grad_norm, reason = (0.0, None) if call.eval_mode else self._finish_optimizer_step(read, loss, gseq, gtok)
        return StepResult(loss, grad_norm, metrics, reason, mb_metrics if self._reports_micro_batches else {})

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _check_train_call(
        self, data: Mapping[str, Any], loss_fn: Any, gbs: int, mbs: int, eval_mode: bool
    ) -> tuple[int, int]:
        """``train``'s input checks (no collective); this rank's rows per global batch and per
        micro batch (``mbs`` per data-parallel device)."""

    @abc.abstractmethod
    def _train_call(
        self, data: BatchedDataDict, loss_fn: LossFunction, local_gbs: int, mbs: int, eval_mode: bool
    ) -> contextlib.AbstractContextManager[CallT]:
        """Prepare the call (modes, device state, compiled steps, learning rate); the block
        runs every global batch of ``data`` (``local_gbs`` rows each) in micro batches of
        ``mbs`` of this rank's rows."""

    @abc.abstractmethod
    def _global_valid_counts(self, gb: Any) -> tuple[Any, Any]:
        """(valid sequences, valid next-token positions) of the whole global batch, every rank's
        rows summed: the loss's normalisers."""

    @abc.abstractmethod
    def _run_micro_batches(self, call: CallT, gb: Any, gseq: Any, gtok: Any) -> tuple[Any, MicroBatchMetrics]:
        """Forward (and, unless ``call.eval_mode``, backward) of each micro batch of ``gb``:
        ``(accumulated gradients or None where the engine keeps them itself, metrics)``."""

    @abc.abstractmethod
    def _device_scalar(self) -> Any:
        """A 0-d float32 array on the engine's device: the metric table's dtype and place."""

    def _sum_over_dp(self, totals: Any) -> Any:
        """Each metric summed over the data-parallel ranks (already global where every rank's
        micro batch spans all of them)."""
        return totals

    @abc.abstractmethod
    def _queue_optimizer_step(self, grads: Any, keys: list[str], totals: Any, gseq: Any, gtok: Any) -> list[Any]:
        """Start the optimizer step; returns device arrays to read with the step's values."""

    @abc.abstractmethod
    def _finish_optimizer_step(
        self, read: list[list[float]], loss: float, gseq: Any, gtok: Any
    ) -> tuple[float, str | None]:
        """After the read (``read``: the queued arrays' values): ``(grad norm, skip reason)``,
        the step applied or dropped where the engine decides on the host."""

    @abc.abstractmethod
    def _advance_schedule(self) -> None:
        """A call applied at least one step: the learning-rate schedule and ``train_step`` move on."""

    @abc.abstractmethod
    def _learning_rate(self) -> float | None:
        """The learning rate after the call (None without an optimizer)."""

    @property
    def _reports_micro_batches(self) -> bool:
        """Whether this worker reports its per-micro-batch metrics (not when another process
        already reports the same micro batches)."""
        return True

    # ------------------------------------------------------------------ the step's one read
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
