"""The ``logger`` section: where and how a run reports its metrics."""

from __future__ import annotations

from pydantic import Field

from core.config import ConfigModel


class LoggerConfig(ConfigModel):
    """Where and how a run reports metrics."""

    log_dir: str = Field(min_length=1)
    """metrics.jsonl, tensorboard/, curves.png (relative paths are resolved on the driver)."""
    jsonl_enabled: bool = True
    """Write metrics.jsonl (one JSON row per step and split)."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files under tensorboard/."""
    progress_bar: bool = True
    """A tqdm bar over the steps."""
    plot_enabled: bool = True
    """A PNG of the curves at the end."""
    num_val_samples_to_print: int = Field(2, ge=0)
    """GRPO: validation completions printed at each validation."""
