"""Weights & Biases as a metric sink (``logger.wandb_enabled``; ``pip install 'dualrl[wandb]'``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.logging.config import WandbConfig
from core.logging.tracking import import_tracker, previous_run_id, save_run_id

#: Under ``logger.log_dir``: the W&B run id a ``--resume`` continues.
WANDB_RUN_ID_FILENAME = "wandb_run_id"


class WandbSink:
    """The run's metrics as W&B history under the TensorBoard names (``train/loss``), at the
    run's own step numbers, with the run config as the W&B config.

    ``resume=True`` continues the W&B run whose id the interrupted run stored in
    ``<log_dir>/wandb_run_id`` (a new run when none was stored).  W&B's steps only increase:
    steps the interrupted run logged after its last checkpoint keep their first values there
    (W&B warns and drops the re-run's), while metrics.jsonl and TensorBoard hold the re-run's.
    Offline (``WANDB_MODE=offline``) each process writes its own ``offline-run-*`` directory
    under the same run id; ``wandb sync`` them in order.  W&B's local files go to
    ``$WANDB_DIR`` when it is set, else under ``log_dir``.
    """

    def __init__(
        self, cfg: WandbConfig, log_dir: Path, *, run_config: Mapping[str, Any] | None = None, resume: bool = False
    ) -> None:
        """Start (or continue) the W&B run; the wandb package is imported here, not before."""
        wandb = import_tracker("wandb_enabled")
        id_file = log_dir / WANDB_RUN_ID_FILENAME
        run_id = previous_run_id(id_file, resume=resume)
        self._run: Any = wandb.init(
            project=cfg.project,
            name=cfg.name,
            id=run_id,
            resume="allow" if run_id else None,
            config=dict(run_config or {}),
            # Passed on every init: wandb reads WANDB_DIR once per process, at its first run.
            dir=os.environ.get("WANDB_DIR") or str(log_dir),
            # create_new: this run must not finish or take over another run of the process
            # (a warm start's run before the main one, tests), nor rely on wandb's global run.
            reinit="create_new",
        )
        self.run_id: str = self._run.id
        save_run_id(id_file, self.run_id)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One history row at ``step`` (a train and a val call at one step share the row)."""
        if self._run is None:
            raise ValueError(f"W&B run {self.run_id}: write after close")
        self._run.log(dict(scalars), step=step)

    def close(self, *, failed: bool = False) -> None:
        """Finish the run, as failed (exit code 1) when the training run failed (idempotent)."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=1 if failed else 0)
