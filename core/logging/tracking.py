"""What the experiment-tracker sinks (Weights & Biases, MLflow) share.

The trackers are optional extras (``pip install 'dualrl[wandb]'`` / ``'dualrl[mlflow]'``):
their packages are imported only when their sink is enabled, and a config that enables one
whose package is missing is refused before any worker starts (:func:`tracker_package_errors`,
run by ``dualrl config`` and by every training command's config check).

A tracker keeps the id of its run in a small file under ``logger.log_dir`` so that a
resumed run (``--resume``) continues the same tracker run instead of starting another.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from core.config import ConfigError
from core.logging.config import LoggerConfig

#: ``logger.<switch>`` -> (the module it imports, the dualrl extra that installs it).
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "wandb_enabled": ("wandb", "wandb"),
    "mlflow_enabled": ("mlflow", "mlflow"),
}


class Tracker(Protocol):
    """A metric sink that talks to an experiment tracker (what ``MetricsLogger`` calls)."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log ``scalars`` (already named ``<split>/<metric>``) at ``step``."""

    def close(self, *, failed: bool = False) -> None:
        """End the tracker run, marked failed when the training run failed (idempotent)."""


def _import_tracker(switch: str) -> tuple[ModuleType | None, str | None]:
    """(the module, None), or (None, the error line naming ``logger.<switch>`` and the extra)."""
    module, extra = TRACKER_PACKAGES[switch]
    try:
        return importlib.import_module(module), None
    except ImportError as err:
        return None, (
            f"logger.{switch}: True needs the {module!r} package, which cannot be imported ({err}): "
            f"pip install 'dualrl[{extra}]', or set logger.{switch}=false"
        )


def import_tracker(switch: str) -> ModuleType:
    """The package of the tracker ``logger.<switch>`` enables; ConfigError when it is missing."""
    module, problem = _import_tracker(switch)
    if module is None:
        raise ConfigError(problem or switch)
    return module


def tracker_package_errors(cfg: LoggerConfig | None) -> list[str]:
    """One error line per enabled tracker whose package cannot be imported (the config check)."""
    if cfg is None:
        return []
    problems = (_import_tracker(switch)[1] for switch in TRACKER_PACKAGES if getattr(cfg, switch))
    return [problem for problem in problems if problem]


def previous_run_id(path: Path, *, resume: bool) -> str | None:
    """The tracker run id stored at ``path`` when resuming; None for a fresh run (or none stored)."""
    if not resume or not path.is_file():
        return None
    return path.read_text(encoding="utf-8").strip() or None


def save_run_id(path: Path, run_id: str) -> None:
    """Store the tracker run id for a later ``--resume`` (a fresh run overwrites the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n", encoding="utf-8")


def flat_params(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """The run config as ``("policy.optimizer.kwargs.lr", "1e-06")`` pairs: trackers whose
    params are flat strings (MLflow) get every leaf, dotted as the CLI's overrides are."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flat_params(value, name + ".")
        else:
            yield name, str(value)
