"""Run logging for the training loops: metric sinks, a progress bar, end-of-run plots and summary.

A loop uses it like this (the ``logger`` section of the run config configures it)::

    metrics = MetricsLogger(config.logger, resume=start_step > 0, run_config=config.to_dict())
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
``tensorboard/`` (scalars ``<split>/<metric>``) and ``curves.png``.  Weights & Biases and
MLflow (``logger.wandb_enabled`` / ``logger.mlflow_enabled``, optional extras) get the same
``<split>/<metric>`` scalars at the same steps and the run config; their run ids are kept in
``wandb_run_id`` / ``mlflow_run_id`` there for ``--resume``.  Importing this package
imports neither torch, jax, ray, matplotlib, tensorboard, wandb nor mlflow (only tqdm).
"""

from core.logging.mlflow_sink import MLFLOW_RUN_ID_FILENAME, MLflowSink
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
    scalar_tags,
    to_float,
)
from core.logging.summary import format_summary, format_val_samples
from core.logging.tracking import tracker_package_errors
from core.logging.wandb_sink import WANDB_RUN_ID_FILENAME, WandbSink

__all__ = [
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "MLflowSink",
    "MetricsLogger",
    "scalar_tags",
    "tracker_package_errors",
    "read_metrics",
    "to_float",
    "METRICS_FILENAME",
    "TENSORBOARD_DIRNAME",
    "WANDB_RUN_ID_FILENAME",
    "MLFLOW_RUN_ID_FILENAME",
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
