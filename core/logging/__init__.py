"""Run logging for the training loops: metric sinks, a progress bar, end-of-run plots and summary.

A loop uses it like this (the ``logger`` section of the run config configures it)::

    metrics = MetricsLogger(config.logger, resume=start_step > 0)
    if start_step:
        metrics.truncate_after(start_step)          # drop rows the crashed run logged later
    bar = StepProgress(max_steps, initial=start_step, enabled=config.logger.progress_bar)
    for step in range(start_step + 1, max_steps + 1):
        train_metrics = ...                         # {"reward_mean": ..., "loss": ..., "step_time_s": ...}
        metrics.log("train", step, train_metrics)
        bar.update(step, train_metrics)
    bar.close(); metrics.close()
    plot_run(metrics.history, metrics.log_dir / PLOT_FILENAME)
    print(format_summary(metrics.history, wall_time_s=..., run_dir=metrics.log_dir))

Files under ``log_dir``: ``metrics.jsonl`` (one JSON row per split and step),
``tensorboard/`` (scalars ``<split>/<metric>``) and ``curves.png``.  Importing this package
imports neither torch, jax, ray, matplotlib nor tensorboard (only tqdm).
"""

from core.logging.plots import plot_pass_at_k, plot_run
from core.logging.progress import (
    PROGRESS_FIELDS,
    STEP_TIME_KEYS,
    TIMING_KEYS,
    StepProgress,
    format_postfix,
    timing_keys_in,
)
from core.logging.sinks import (
    METRICS_FILENAME,
    PLOT_FILENAME,
    TENSORBOARD_DIRNAME,
    JsonlSink,
    MetricsLogger,
    TensorBoardSink,
    read_metrics,
    to_float,
)
from core.logging.summary import format_summary, format_val_samples

__all__ = [
    "JsonlSink",
    "TensorBoardSink",
    "MetricsLogger",
    "read_metrics",
    "to_float",
    "METRICS_FILENAME",
    "TENSORBOARD_DIRNAME",
    "PLOT_FILENAME",
    "StepProgress",
    "PROGRESS_FIELDS",
    "STEP_TIME_KEYS",
    "TIMING_KEYS",
    "format_postfix",
    "timing_keys_in",
    "plot_run",
    "plot_pass_at_k",
    "format_summary",
    "format_val_samples",
]
