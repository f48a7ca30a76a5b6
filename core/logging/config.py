"""The ``logger`` section: where and how a run reports its metrics."""

from __future__ import annotations

from pydantic import Field

from core.config import ConfigModel


class WandbConfig(ConfigModel):
    """``logger.wandb``: the Weights & Biases run (read when ``logger.wandb_enabled``)."""

    project: str | None = Field(None, min_length=1)
    """W&B project; None: W&B's own choice (``WANDB_PROJECT``, else "uncategorized")."""
    name: str | None = Field(None, min_length=1)
    """Display name of the run; None: W&B generates one."""


class MLflowConfig(ConfigModel):
    """``logger.mlflow``: the MLflow run (read when ``logger.mlflow_enabled``)."""

    experiment_name: str = Field("dualrl", min_length=1)
    """MLflow experiment the run belongs to (created when it does not exist)."""
    run_name: str | None = Field(None, min_length=1)
    """Display name of the run; None: MLflow generates one."""
    tracking_uri: str | None = Field(None, min_length=1)
    """Tracking server or store (``http://host:5000``, ``file:///abs/mlruns``); None: MLflow's
    default (``MLFLOW_TRACKING_URI``, else its local store)."""


class LoggerConfig(ConfigModel):
    """Where and how a run reports metrics."""

    log_dir: str = Field(min_length=1)
    """metrics.jsonl, tensorboard/, curves.png (relative paths are resolved on the driver)."""
    jsonl_enabled: bool = True
    """Write metrics.jsonl (one JSON row per step and split)."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files under tensorboard/."""
    wandb_enabled: bool = False
    """Log the same metrics and the run config to Weights & Biases (``pip install 'dualrl[wandb]'``)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """The W&B run's project and name."""
    mlflow_enabled: bool = False
    """Log the same metrics and the run config (as params) to MLflow (``pip install 'dualrl[mlflow]'``)."""
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    """The MLflow experiment, run name and tracking URI."""
    progress_bar: bool = True
    """A tqdm bar over the steps."""
    plot_enabled: bool = True
    """A PNG of the curves at the end."""
    num_val_samples_to_print: int = Field(2, ge=0)
    """GRPO: validation completions printed at each validation."""
