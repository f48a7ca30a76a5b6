"""The ``checkpointing`` section: run checkpoints (policy state + data position + RNG +
config), written atomically; resume; the final HF export."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import Field

from core.config import ConfigModel, Problem


class CheckpointingConfig(ConfigModel):
    """Run checkpoints: policy state + data position + RNG + config, written atomically."""

    enabled: bool = True
    """Write run checkpoints (resume works either way)."""
    checkpoint_dir: str | None = None
    """Where step_N/ directories go; required when enabled or resume."""
    save_period: int = Field(10, ge=1)
    """Every N steps (and at the last step)."""
    keep_top_k: int | None = Field(None, ge=1)
    """Complete checkpoints kept (null = all); the newest is always kept."""
    metric_name: str | None = Field(None, min_length=1)
    """Keep the best by this metric (e.g. "val/accuracy"); null = the newest."""
    higher_is_better: bool = True
    """Whether a larger metric_name value is better."""
    resume: bool = False
    """Continue from the latest complete checkpoint (the CLI's --resume)."""
    export_hf_dir: str | None = Field(None, min_length=1)
    """At the end, the final policy as an HF model (+ tokenizer) here: the next stage's policy.model_name."""

    def check(self) -> Iterable[Problem]:
        if not self.checkpoint_dir and (self.enabled or self.resume):
            yield "checkpoint_dir", "required when enabled or resume is true"

    @property
    def directory(self) -> Path | None:
        """``checkpoint_dir`` as an absolute path (None when not set)."""
        return Path(self.checkpoint_dir).expanduser().absolute() if self.checkpoint_dir else None
