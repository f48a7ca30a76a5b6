"""The training loop every algorithm shares: steps, validation, logging, progress, checkpoints.

An algorithm supplies what is its own -- one training step, one validation pass, how its
state is saved -- and :class:`TrainingLoop` does the rest the same way for GRPO, SFT and
DPO: the step schedule, ``val_period`` / ``val_at_start`` / ``val_at_end``, metrics to the
sinks and the progress bar, ``checkpointing.save_period`` saves (with the driver's data
position and RNG state), and a stop before a non-finite loss can reach a checkpoint.

A non-finite step the policy *skipped* (``policy.non_finite_step: skip``: weights and
optimizer state unchanged, reported as ``skipped_steps``) does not stop the run; with
``non_finite_step: error`` the policy's error stops it, naming the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.checkpointing import CheckpointManager, capture_rng_state
from core.interfaces import NonFiniteStepError
from core.logging import MetricsLogger, StepProgress


class NonFiniteLossError(RuntimeError):
    """A step produced a NaN/inf loss or gradient norm: the run stops before saving it."""


@dataclass
class TrainingLoop:
    algorithm: str
    max_steps: int
    step_fn: Callable[[int], dict[str, float]]  # step number (1-based) -> train metrics
    validate_fn: Callable[[int], dict[str, float]] | None  # step -> val metrics (no "val/" prefix)
    write_policy: Callable[[Path], None]  # save the policy's state under the given directory
    train_state_fn: Callable[[], dict[str, Any]]  # the driver's state (data position, counters)
    logger: MetricsLogger
    progress: StepProgress
    checkpoints: CheckpointManager
    config: Mapping[str, Any]
    val_period: int = 0
    val_at_start: bool = False
    val_at_end: bool = True
    should_stop: Callable[[], str | None] = lambda: None  # a reason to end early (e.g. epochs done)
    last_val: dict[str, float] = field(default_factory=dict)
    _last_metrics: dict[str, float] = field(default_factory=dict)
    _last_saved: int = -1

    def run(self, start_step: int = 0) -> int:
        """Steps ``start_step + 1 .. max_steps``; returns the last step run."""
        if self.val_at_start and start_step == 0:
            self._validate(0)
        step = start_step
        for step in range(start_step + 1, self.max_steps + 1):
            try:
                metrics = self.step_fn(step)
            except NonFiniteStepError as err:
                raise NonFiniteLossError(f"step {step}: {err}") from err
            except Exception:
                # A step that fails (an engine died, a reward raised) fails before it trains:
                # the policy still holds step - 1, saved here so that --resume picks it up.
                self._save_after_failure(step - 1, start_step)
                raise
            _check_finite(step, metrics)
            self._last_metrics = dict(metrics)
            self.logger.log("train", step, metrics)
            self.progress.update(step, metrics)
            reason = self.should_stop()
            last = step == self.max_steps or reason is not None
            if self._validation_due(step, last):
                self._validate(step)
            if self.checkpoints.enabled and self.checkpoints.should_save(step, last_step=last):
                self._save(step, metrics)
            if reason is not None:
                self.progress.write(f"stopping after step {step}: {reason}")
                break
        return step

    def _validation_due(self, step: int, last: bool) -> bool:
        if self.validate_fn is None:
            return False
        return (self.val_period > 0 and step % self.val_period == 0) or (last and self.val_at_end)

    def _validate(self, step: int) -> None:
        if self.validate_fn is None:
            raise ValueError(f"{self.algorithm}: validation was asked for (val_at_start) but the run has no validation")
        start = time.perf_counter()
        metrics = dict(self.validate_fn(step))
        metrics["timing/val_s"] = time.perf_counter() - start
        self.last_val = metrics
        self.logger.log("val", step, metrics)
        self.progress.update(step, {f"val/{k}": v for k, v in metrics.items()})

    def _save_after_failure(self, step: int, start_step: int) -> None:
        if not self.checkpoints.enabled or step <= start_step or step == self._last_saved:
            return
        try:
            self._save(step, self._last_metrics)
        except Exception as err:  # the step's own error is the one to report
            self.progress.write(f"could not save a checkpoint after the failure: {type(err).__name__}: {err}")

    def _save(self, step: int, metrics: Mapping[str, float]) -> None:
        start = time.perf_counter()
        summary = {**metrics, **{f"val/{k}": v for k, v in self.last_val.items()}}
        path = self.checkpoints.save(
            step,
            self.write_policy,
            train_state=self.train_state_fn(),
            config=self.config,
            metrics=summary,
            rng_state=capture_rng_state(),
        )
        self._last_saved = step
        self.progress.write(f"step {step}: checkpoint {path} ({time.perf_counter() - start:.1f} s)")


def _check_finite(step: int, metrics: Mapping[str, float]) -> None:
    if metrics.get("skipped_steps"):
        # The non-finite values belong to optimizer steps the policy skipped on every rank
        # (an applied step's loss and grad norm are finite): nothing bad reached the weights.
        return
    for key in ("loss", "grad_norm"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise NonFiniteLossError(
                f"step {step}: {key} is {value}; stopping before this step is checkpointed (the last saved "
                "checkpoint is intact). Lower policy.optimizer.kwargs.lr or check the rewards / advantages."
            )
