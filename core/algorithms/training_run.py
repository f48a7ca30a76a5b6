"""The parts of a training run every algorithm shares: GRPO, SFT and DPO build on these.

    cfg = check_run_config(cfg, "sft")          # schema + what this algorithm accepts
    run = open_run(TrainingRun, "sft", cfg, resolved_cfg, tokenizer, loader, val_set, loss_fn)
    start_policy(run)                           # Ray, the cluster, the Policy (resumed weights)
    train_loop(run, step_fn, validate_fn)       # TrainingLoop with the run's schedule and checkpoints
    summary = finish_run(run, wall_time_s)      # plot, HF export, one screen of summary

What the run has to say goes to the ``dualrl`` loggers (:mod:`core.reporting`), shown above
the progress bar by the commands.

``open_run`` restores a resumed run's data position and RNG state and trims the metrics
log past the checkpoint, so a resumed run logs exactly what the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from core.algorithms.config import RUN_CONFIGS, MasterConfig
from core.algorithms.loop import TrainingLoop
from core.algorithms.run_setup import run_identity
from core.checkpointing import CheckpointManager, LoadedCheckpoint, restore_rng_state
from core.config import ConfigError
from core.datasets import BatchLoader, EncodedDataset
from core.interfaces import LossFunction, TrainResult
from core.logging import (
    METRICS_FILENAME,
    PLOT_FILENAME,
    MetricsLogger,
    StepProgress,
    format_summary,
    plot_run,
    read_metrics,
    tracker_package_errors,
)
from core.policy.preflight import preflight_errors
from core.reporting import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.config import DPORunConfig, GRPOConfig, GRPORunConfig, SFTConfig, SFTRunConfig
    from core.distributed import RayVirtualCluster
    from core.policy import Policy

logger = get_logger(__name__)


@dataclass
class TrainingRun:
    """The live parts of a run (``close()`` stops the workers and closes the sinks)."""

    algorithm: str  # "grpo" | "sft" | "dpo": also the name of the config section of its loop
    cfg: MasterConfig  # the command's run config, as configured (built-in model names kept)
    resolved_cfg: MasterConfig  # policy.model_name resolved to a loadable path
    tokenizer: PreTrainedTokenizerBase
    loader: BatchLoader
    val_dataset: EncodedDataset
    loss_fn: LossFunction
    checkpoints: CheckpointManager
    resumed: LoadedCheckpoint | None
    logger: MetricsLogger
    progress: StepProgress
    #: The prompt loader's position after the last trained step (None: the loader's own).
    trained_loader_state: dict[str, Any] | None = None
    #: Set by ``close(failed=True)``: the trackers (W&B, MLflow) mark their runs failed.
    failed: bool = False
    _policy: Policy | None = field(default=None, repr=False)
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def policy(self) -> Policy:
        """The run's policy (started by :func:`start_policy`)."""
        if self._policy is None:
            raise RuntimeError(f"the {self.algorithm} run's workers are not started: no policy yet")
        return self._policy

    @property
    def section(self) -> GRPOConfig | SFTConfig:
        """The algorithm's own config section (``grpo`` / ``sft`` / ``dpo``)."""
        section = getattr(self.cfg, self.algorithm)
        if section is None:  # every run config requires its own section
            raise ConfigError(f"a {self.algorithm} run needs its {self.algorithm} section")
        return section

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed is not None else 0

    def data_position(self) -> dict[str, Any]:
        """What a checkpoint saves of the data: the loader's position after the last trained
        step (the async GRPO loop draws the next steps' prompts ahead of training)."""
        return self.trained_loader_state if self.trained_loader_state is not None else self.loader.state_dict()

    def close(self, *, failed: bool = False) -> None:
        """Stop the workers and close the sinks; ``failed``: the run ends in an error."""
        self.failed = self.failed or failed
        self._exit.close()


@overload
def check_run_config(cfg: MasterConfig | Mapping[str, Any], algorithm: Literal["grpo"]) -> GRPORunConfig: ...
@overload
def check_run_config(cfg: MasterConfig | Mapping[str, Any], algorithm: Literal["sft"]) -> SFTRunConfig: ...
@overload
def check_run_config(cfg: MasterConfig | Mapping[str, Any], algorithm: Literal["dpo"]) -> DPORunConfig: ...
def check_run_config(cfg: MasterConfig | Mapping[str, Any], algorithm: str) -> MasterConfig:
    """``cfg`` as ``dualrl <algorithm>``'s run config (what the command accepts, every rule
    between its sections), then the preflight against the model's files and the classes it
    names, and the packages of the enabled trackers; :class:`ConfigError` listing every
    problem otherwise."""
    schema = RUN_CONFIGS[algorithm]
    if isinstance(cfg, MasterConfig) and not isinstance(cfg, schema):
        cfg = cfg.to_dict()
    run_cfg = schema.coerce(cfg)
    errors = preflight_errors(run_cfg.policy) + tracker_package_errors(run_cfg.logger)
    if errors:
        raise ConfigError(errors)
    return run_cfg


R = TypeVar("R", bound="TrainingRun")


def open_run(
    run_cls: type[R],
    algorithm: str,
    cfg: MasterConfig,
    resolved: MasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    loader: BatchLoader,
    val_dataset: EncodedDataset,
    loss_fn: LossFunction,
) -> R:
    """A ``run_cls`` (``TrainingRun`` or a subclass whose own fields have defaults) with its
    checkpoints, sinks and progress bar; a resumed run continues its data and RNG state."""
    if cfg.checkpointing is None or cfg.logger is None:  # every run config requires both
        raise ConfigError("a training run needs the checkpointing and logger sections")
    checkpoints = CheckpointManager(cfg.checkpointing, identity=run_identity(algorithm, cfg, resolved))
    resumed = checkpoints.resume_point()
    if resumed is not None:
        loader.load_state_dict(resumed.train_state["loader"])
        restore_rng_state(resumed.rng_state)
    metrics = MetricsLogger(cfg.logger, resume=resumed is not None, run_config=cfg.to_dict())
    if resumed is not None:
        metrics.truncate_after(resumed.step)
    section = getattr(cfg, algorithm)
    progress = StepProgress(
        section.max_num_steps,
        initial=resumed.step if resumed else 0,
        enabled=cfg.logger.progress_bar,
        desc=f"{algorithm} {cfg.policy.backend}",
    )
    run = run_cls(
        algorithm, cfg, resolved, tokenizer, loader, val_dataset, loss_fn, checkpoints, resumed, metrics, progress
    )
    run._exit.callback(lambda: metrics.close(failed=run.failed))
    run._exit.callback(progress.close)
    return run


def start_policy(run: TrainingRun, *, reference: bool | None = None) -> RayVirtualCluster:
    """Ray, the training cluster and the Policy (from the resumed checkpoint if any); the
    cluster is returned for engines that share it.  ``reference``: whether the policy keeps
    reference weights (None: :func:`needs_reference`)."""
    from core.algorithms.placement import policy_cluster, start_ray
    from core.distributed.worker_output import current_worker_log
    from core.policy import Policy

    cfg, ckpt = run.resolved_cfg, run.resumed
    start_ray(cfg)
    worker_log = current_worker_log()
    if worker_log:
        shown = os.path.relpath(worker_log)
        logger.info("worker output (vLLM, libraries): %s", worker_log if shown.startswith("..") else shown)
    cluster = policy_cluster(cfg)
    run._exit.callback(cluster.shutdown)
    policy = Policy(
        cluster,
        cfg.policy,
        run.tokenizer,
        weights_path=None if ckpt is None else ckpt.policy_dir / "weights",
        optimizer_path=None if ckpt is None else ckpt.policy_dir / "optimizer",
        init_reference_model=needs_reference(run) if reference is None else reference,
    )
    run._policy = policy
    run._exit.callback(policy.shutdown)
    return cluster


def needs_reference(run: TrainingRun) -> bool:
    """Whether the policy keeps frozen reference weights: DPO's implicit rewards and GRPO's
    KL term use them; SFT, and GRPO without a KL term, do not (and save their host memory)."""
    return run.algorithm == "dpo" or bool(getattr(run.loss_fn, "uses_reference", False))


def train_loop(
    run: TrainingRun, step_fn: Callable[[int], dict[str, float]], validate_fn: Callable[[int], dict[str, float]] | None
) -> int:
    """Run the steps left (from a resumed step if any) on ``TrainingLoop``; the last step."""
    section = run.section

    def write_policy(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        run.policy.save_checkpoint(str(path / "weights"), str(path / "optimizer"), str(path / "tokenizer"))

    def epochs_done() -> str | None:
        limit = section.max_num_epochs
        return f"{limit} epoch(s) over the data" if limit and run.loader.epoch >= limit else None

    loop = TrainingLoop(
        algorithm=run.algorithm,
        max_steps=section.max_num_steps,
        step_fn=step_fn,
        validate_fn=validate_fn,
        write_policy=write_policy,
        train_state_fn=lambda: {"loader": run.data_position()},
        logger=run.logger,
        progress=run.progress,
        checkpoints=run.checkpoints,
        config=run.cfg.to_dict(),
        val_period=section.val_period,
        val_at_start=section.val_at_start,
        val_at_end=section.val_at_end,
        should_stop=epochs_done,
    )
    return loop.run(run.start_step)


def train_metrics(result: TrainResult) -> dict[str, float]:
    """``Policy.train``'s result as floats (mean over the step's optimizer steps), with
    ``skipped_steps``: how many of its optimizer steps were skipped (non-finite loss / grad
    norm, or no valid token; their loss / grad norm stay in the means as they were)."""
    out = {
        "loss": _mean(result.loss),
        "grad_norm": _mean(result.grad_norm),
        "skipped_steps": float(result.skipped_steps),
    }
    if result.lr is not None:
        out["lr"] = float(result.lr)
    out.update({key: _mean(values) for key, values in result.metrics.items() if key != "loss"})
    if result.timing is not None:  # where the train phase's seconds went (not in timing/*: no double count)
        t = result.timing
        out.update(
            {
                "train_call/checks_s": t.checks_s,
                "train_call/shard_s": t.shard_s,
                "train_call/dispatch_s": t.dispatch_s,
                "train_call/worker_s": t.worker_s,
            }
        )
    return out


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def report_skipped_steps(step: int, result: TrainResult) -> None:
    """A warning per optimizer step ``Policy.train`` skipped in run step ``step``: why
    (non-finite loss / grad norm, no valid tokens) and the values; nothing if none was."""
    from core.policy.policy import describe_skipped_steps

    for phrase in describe_skipped_steps(result):
        logger.warning(
            "step %d: %s; weights and optimizer state unchanged (policy.non_finite_step: skip)", step, phrase
        )


def finish_run(run: TrainingRun, wall_time_s: float, extra: Mapping[str, Any] | None = None) -> str:
    """The HF export (``checkpointing.export_hf_dir``), the end-of-run plot (if enabled),
    and one screen of summary."""
    if run.cfg.checkpointing is None or run.cfg.logger is None:  # open_run refused both
        raise ConfigError("a training run needs the checkpointing and logger sections")
    export = run.cfg.checkpointing.export_hf_dir
    if export:
        start = time.perf_counter()
        run.policy.save_hf_checkpoint(str(export), save_tokenizer=True)
        logger.info("final policy exported as an HF model to %s (%.1f s)", export, time.perf_counter() - start)
    metrics_path = run.logger.log_dir / METRICS_FILENAME
    history = read_metrics(metrics_path) if metrics_path.is_file() else list(run.logger.history)
    if run.cfg.logger.plot_enabled and history:
        plot_run(
            history,
            run.logger.log_dir / PLOT_FILENAME,
            algorithm=run.algorithm,
            title=f"{run.algorithm.upper()} {run.cfg.policy.backend} - {run.cfg.policy.model_name}",
        )
    info = {"backend": run.cfg.policy.backend, "model": run.cfg.policy.model_name, **(extra or {})}
    if export:
        info["hf export"] = export
    return format_summary(history, wall_time_s=wall_time_s, run_dir=run.logger.log_dir, extra=info)


def execute(
    setup: Callable[[], R], train: Callable[[R], object], report_extra: Callable[[R], Mapping[str, str]]
) -> tuple[R, str]:
    """Set up, train, report, shut down: what ``dualrl <algorithm>`` does.  Returns the (closed)
    run and its one screen of summary."""
    start = time.perf_counter()
    run = setup()
    done = False
    try:
        train(run)
        run.progress.close()
        summary = finish_run(run, time.perf_counter() - start, report_extra(run))
        done = True
    finally:
        run.close(failed=not done)
    return run, summary
