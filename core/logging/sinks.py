"""Metric sinks: a JSONL file, TensorBoard, and the fan-out the training loops call (which
also feeds the optional experiment trackers, :mod:`core.logging.wandb_sink` and
:mod:`core.logging.mlflow_sink`).

Every row the loop logs becomes one JSON object per line of ``<log_dir>/metrics.jsonl``::

    {"step": 3, "split": "train", "time": 1718000000.1, "reward_mean": 0.5, "loss": 0.01}

Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``: plain
JSON has no spelling for them (Python's ``NaN`` token breaks other readers such as ``jq``)
and writing ``null`` would hide the fact that a loss diverged.  :func:`read_metrics` turns
them back into floats.

TensorBoard, W&B and MLflow show a metric as ``<split>/<metric name>`` (:func:`scalar_tags`).
Importing this module needs neither torch, tensorboard, wandb nor mlflow: each is imported
when its sink is created.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from core.logging.config import LoggerConfig
from core.logging.tracking import Tracker
from core.reporting import get_logger

_log = get_logger(__name__)

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
PLOT_FILENAME = "curves.png"

# Keys every row carries; a metric with one of these names would overwrite them.
RESERVED_KEYS = ("step", "split", "time")

V = TypeVar("V")

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_float(value: Any) -> float | None:
    """A metric value as a Python float, or None when it is not a scalar number.

    Accepts Python numbers (bools included), and 0-d torch tensors, numpy arrays or
    scalars and jax arrays, duck-typed through ``.item()`` so that no framework is
    imported here.  Lists, strings, None and arrays with more than one element -> None.
    """
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if item is None or tuple(getattr(value, "shape", (None,))) != ():
        return None
    try:
        scalar = item()
    except (TypeError, ValueError, RuntimeError):
        return None
    return float(scalar) if isinstance(scalar, numbers.Real) else None


def _encode(value: float) -> float | str:
    """A float as JSON can hold it: non-finite values become their string spelling."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Turn the ``"nan"``/``"inf"``/``"-inf"`` strings of a JSONL row back into floats."""
    return {
        k: (_NON_FINITE[v] if k != "split" and isinstance(v, str) and v in _NON_FINITE else v) for k, v in row.items()
    }


def make_row(split: str, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """The dict logged for one (split, step): reserved keys first, then the metrics."""
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty string, got {split!r}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    row: dict[str, Any] = {"step": int(step), "split": split, "time": time.time()}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric names must be non-empty strings, got {name!r}")
        if name in RESERVED_KEYS:
            raise ValueError(f"metric name {name!r} is reserved (rows already carry {RESERVED_KEYS})")
        number = to_float(value)
        if number is None:
            raise TypeError(f"metric {name!r}: {value!r} is not a scalar number")
        row[name] = number
    return row


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(raw line, parsed row) for each line of a metrics file.

    A malformed *last* line that has no trailing newline is what a crash in the middle
    of a write leaves behind: it is skipped with a warning.  Any other malformed line
    (or a row without an int ``step`` and a string ``split``) raises ValueError naming
    the file and the 1-based line number.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = _row_problem(row)
        except json.JSONDecodeError as err:
            row, problem = None, f"invalid JSON ({err.msg})"
        if problem is None:
            yield line, row
        elif index == len(lines) - 1:  # no newline after it: an interrupted write
            _log.warning("%s: skipping truncated last line %d (%s)", path, index + 1, problem)
        else:
            raise ValueError(f"{path}: line {index + 1}: {problem}: {line[:120]!r}")


def _row_problem(row: Any) -> str | None:
    """Why a parsed JSON value is not a metrics row, or None when it is one."""
    if not isinstance(row, dict):
        return "not a JSON object"
    if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return "missing or non-integer 'step'"
    if not isinstance(row.get("split"), str):
        return "missing or non-string 'split'"
    return None


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file, non-finite values back as floats."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    return [_decode_row(row) for _, row in _iter_jsonl(path)]


class JsonlSink:
    """Appends one JSON object per logged (split, step) to a file, flushed per line."""

    def __init__(self, path: Path | str, *, append: bool) -> None:
        """Open ``path`` (parents created); ``append=True`` keeps earlier rows (resume)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            self._drop_partial_last_line()
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def _drop_partial_last_line(self) -> None:
        """Cut the unterminated tail a crash mid-write left, so appended rows start a line.

        Without this the first new row would be glued to the broken one and the file
        would have a malformed line in the middle, which :func:`read_metrics` rejects.
        """
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        _log.warning("%s: dropping a partial last line left by an interrupted write", self.path)
        with open(self.path, "r+b") as f:
            f.truncate(keep)

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        """Write one row and flush it, so that a crash loses no logged step."""
        self.write_row(make_row(split, step, metrics))

    def write_row(self, row: Mapping[str, Any]) -> None:
        """Write an already built row (see :func:`make_row`) and flush it."""
        if self._file.closed:
            raise ValueError(f"{self.path}: write after close")
        encoded = {k: (_encode(v) if isinstance(v, float) else v) for k, v in row.items()}
        # allow_nan=False: a non-finite value that slipped past _encode must fail loudly.
        self._file.write(json.dumps(encoded, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


def scalar_tags(split: str, metrics: Mapping[str, V]) -> dict[str, V]:
    """Metrics under the names TensorBoard, W&B and MLflow show: ``train/loss``, ``val/accuracy``."""
    return {f"{split}/{name}": value for name, value in metrics.items()}


class TensorBoardSink:
    """Scalars under ``<log_dir>/tensorboard`` as ``<split>/<metric name>``."""

    def __init__(self, log_dir: Path | str, *, purge_step: int | None = None) -> None:
        """Create the writer; ``purge_step`` hides events at steps >= it (a resumed run)."""
        from torch.utils.tensorboard import SummaryWriter  # lazy: torch is heavy

        self.log_dir = Path(log_dir) / TENSORBOARD_DIRNAME
        # flush_secs=10: a crashed run keeps all but the last seconds of its curves.
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step, flush_secs=10)

    def write(self, split: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Add every numeric metric as a scalar; other values are skipped."""
        numbers = {name: to_float(value) for name, value in metrics.items() if name not in RESERVED_KEYS}
        for tag, number in scalar_tags(split, numbers).items():
            if number is not None:
                self._writer.add_scalar(tag, number, int(step))

    def flush(self) -> None:
        """Push pending events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, value) pairs with nested mappings joined by '/', keeping one flat namespace."""
    for name, value in metrics.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from _flatten(value, key + "/")
        else:
            yield key, value


def open_trackers(
    cfg: LoggerConfig, log_dir: Path, *, run_config: Mapping[str, Any] | None, resume: bool
) -> list[Tracker]:
    """The enabled experiment trackers (W&B, MLflow); their modules are imported only here,
    and one that fails to start closes (as failed) those already started."""
    trackers: list[Tracker] = []
    try:
        if cfg.wandb_enabled:
            from core.logging.wandb_sink import WandbSink

            trackers.append(WandbSink(cfg.wandb, log_dir, run_config=run_config, resume=resume))
        if cfg.mlflow_enabled:
            from core.logging.mlflow_sink import MLflowSink

            trackers.append(MLflowSink(cfg.mlflow, log_dir, run_config=run_config, resume=resume))
    except BaseException:
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    return trackers


class MetricsLogger:
    """What the training loops call: one ``log`` call fans out to the enabled sinks."""

    def __init__(
        self,
        logger_cfg: LoggerConfig | Mapping[str, Any],
        *,
        resume: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        """Open the sinks under ``logger.log_dir``; ``resume`` appends to metrics.jsonl and
        continues the trackers' runs; ``run_config`` (the whole run's config) goes to the
        trackers as their config / params."""
        self.config = LoggerConfig.coerce(logger_cfg, "logger")
        self.log_dir = Path(self.config.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, Any]] = []
        self._dropped: set[str] = set()
        self._closed = False
        self._jsonl: JsonlSink | None = None
        self._tb: TensorBoardSink | None = None
        self._trackers: list[Tracker] = []
        try:
            # Trackers first: one that cannot start (a missing package, a server refusing)
            # fails before a fresh run's metrics.jsonl is truncated.
            self._trackers = open_trackers(self.config, self.log_dir, run_config=run_config, resume=resume)
            self._jsonl = JsonlSink(self.metrics_path, append=resume) if self.config.jsonl_enabled else None
            self._tb = TensorBoardSink(self.log_dir) if self.config.tensorboard_enabled else None
        except BaseException:
            self.close(failed=True)
            raise

    @property
    def metrics_path(self) -> Path:
        """Where the JSONL rows go (whether or not the JSONL sink is enabled)."""
        return self.log_dir / METRICS_FILENAME

    @property
    def tensorboard_dir(self) -> Path | None:
        """The TensorBoard event directory, or None when TensorBoard is disabled."""
        return self.log_dir / TENSORBOARD_DIRNAME if self.config.tensorboard_enabled else None

    def log(self, split: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for (split, step); non-scalar values are dropped, not fatal.

        Loops hand over whatever their step functions return (tensors, numpy scalars,
        lists of per-sample values, strings); only scalar numbers are kept, each dropped
        name is reported once per run so that a typo'd metric is noticed.
        """
        if self._closed:
            raise ValueError(f"MetricsLogger({self.log_dir}) is closed: cannot log {split!r} step {step}")
        scalars: dict[str, float] = {}
        for name, value in _flatten(metrics):
            number = to_float(value)
            if number is None:
                if name not in self._dropped:
                    self._dropped.add(name)
                    _log.warning("metric %r (%s) is not a scalar number: not logged", name, type(value).__name__)
                continue
            scalars[name] = number
        row = make_row(split, step, scalars)
        self.history.append(row)
        if self._jsonl is not None:
            self._jsonl.write_row(row)
        if self._tb is not None:
            self._tb.write(split, row["step"], scalars)
        if self._trackers:
            tags = scalar_tags(split, scalars)
            for tracker in self._trackers:
                tracker.write(row["step"], tags)

    def truncate_after(self, step: int) -> None:
        """Forget rows with step > ``step``: call it when resuming from the checkpoint at ``step``.

        The crashed run may have logged steps after its last checkpoint; those steps will
        be run again, so their old rows are removed from metrics.jsonl (rewritten through a
        temporary file and ``os.replace``, so a crash here leaves the old or the new file)
        and TensorBoard is reopened with ``purge_step=step + 1`` to hide their events.
        The trackers cannot forget logged points: see :class:`~core.logging.wandb_sink.WandbSink`
        and :class:`~core.logging.mlflow_sink.MLflowSink` for what they show of those steps.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"truncate_after: step must be a non-negative int, got {step!r}")
        self.history = [row for row in self.history if row["step"] <= step]
        if self._jsonl is not None:
            self._jsonl.close()
            if self.metrics_path.is_file():
                _rewrite_keeping(self.metrics_path, step)
            self._jsonl = JsonlSink(self.metrics_path, append=True)
        if self._tb is not None:
            self._tb.close()
            self._tb = TensorBoardSink(self.log_dir, purge_step=step + 1)

    def close(self, *, failed: bool = False) -> None:
        """Close every sink (idempotent); ``failed`` marks the trackers' runs failed.  Every
        sink is closed even when one raises (the first error is raised after)."""
        files = [sink for sink in (self._jsonl, self._tb) if sink is not None]
        trackers, self._trackers = self._trackers, []
        self._jsonl = self._tb = None
        self._closed = True
        with contextlib.ExitStack() as stack:
            for sink in files:
                stack.callback(sink.close)
            for tracker in trackers:
                stack.callback(tracker.close, failed=failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _rewrite_keeping(path: Path, max_step: int) -> None:
    """Atomically rewrite a metrics file with only its rows of step <= ``max_step``."""
    kept = [line for line, row in _iter_jsonl(path) if row["step"] <= max_step]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
