"""MLflow as a metric sink (``logger.mlflow_enabled``; ``pip install 'dualrl[mlflow]'``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from core.logging.config import MLflowConfig
from core.logging.tracking import flat_params, import_tracker, previous_run_id, save_run_id
from core.reporting import get_logger

_log = get_logger(__name__)

#: Under ``logger.log_dir``: the MLflow run id a ``--resume`` continues.
MLFLOW_RUN_ID_FILENAME = "mlflow_run_id"

T = TypeVar("T")


class MLflowSink:
    """The run's metrics as MLflow metrics under the TensorBoard names (``train/loss``), at
    the run's own step numbers, with every leaf of the run config as a param
    (``policy.optimizer.kwargs.lr``).

    It goes through an ``MlflowClient`` with an explicit run id, so it neither needs nor
    changes MLflow's global "active run".  ``resume=True`` continues the run whose id the
    interrupted run stored in ``<log_dir>/mlflow_run_id`` (marked RUNNING again; a new run
    when none was stored or the tracking store does not have it).  MLflow cannot delete
    metric points: steps the interrupted run logged after its last checkpoint show both
    values, where metrics.jsonl and TensorBoard keep only the re-run's.
    """

    def __init__(
        self, cfg: MLflowConfig, log_dir: Path, *, run_config: Mapping[str, Any] | None = None, resume: bool = False
    ) -> None:
        """Create (or reopen) the run and log the config; mlflow is imported here, not before."""
        import_tracker("mlflow_enabled")
        from mlflow.tracking import MlflowClient

        self._client: Any = MlflowClient(tracking_uri=cfg.tracking_uri)
        id_file = log_dir / MLFLOW_RUN_ID_FILENAME
        self.run_id: str = self._reopen(previous_run_id(id_file, resume=resume)) or self._create(cfg)
        save_run_id(id_file, self.run_id)
        self._closed = False
        try:
            self._log_params(dict(flat_params(run_config or {})))
        except BaseException:
            self.close(failed=True)
            raise

    def _create(self, cfg: MLflowConfig) -> str:
        experiment = self._client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(cfg.experiment_name)
        return str(self._client.create_run(experiment_id, run_name=cfg.run_name).info.run_id)

    def _reopen(self, run_id: str | None) -> str | None:
        """``run_id`` marked RUNNING again, or None when there is none to continue."""
        from mlflow.exceptions import MlflowException

        if run_id is None:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as err:
            _log.warning("MLflow run %s cannot be continued (%s): starting a new run", run_id, err)
            return None
        return run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the params the run does not have yet: MLflow refuses to change a logged param,
        so a resumed run whose config differs keeps the first values (and says which)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {key: value[:MAX_PARAM_VAL_LENGTH] for key, value in params.items()}
        logged = self._client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in params.items() if key in logged and logged[key] != value)
        if changed:
            _log.warning("MLflow run %s keeps its first values of params %s (changed on resume)", self.run_id, changed)
        new = [Param(key, value) for key, value in params.items() if key not in logged]
        for batch in _batches(new, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=batch)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log every scalar at ``step`` (one request per MLflow batch limit)."""
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        if self._closed:
            raise ValueError(f"MLflow run {self.run_id}: write after close")
        now_ms = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now_ms, int(step)) for name, value in scalars.items()]
        for batch in _batches(metrics, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch)

    def close(self, *, failed: bool = False) -> None:
        """End the run as FINISHED, or FAILED when the training run failed (idempotent)."""
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _batches(items: Sequence[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch
