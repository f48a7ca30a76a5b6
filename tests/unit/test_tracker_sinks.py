"""core.logging's experiment trackers: Weights & Biases and MLflow as optional metric sinks.

Offline only: W&B runs with ``WANDB_MODE=offline`` and its run file is read back record by
record; MLflow writes to a file store that ``MlflowClient`` reads back.  Both are compared
with the rows of metrics.jsonl.  The tracker tests skip where their (optional) package is
not installed; the missing-package tests hide the package and run everywhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from core.config import EMBEDDED_CONFIGS, ConfigError
from core.logging import (
    MLFLOW_RUN_ID_FILENAME,
    WANDB_RUN_ID_FILENAME,
    MetricsLogger,
    read_metrics,
    tracker_package_errors,
)
from core.logging.config import LoggerConfig

RUN_CONFIG = {"grpo": {"seed": 7, "max_num_steps": 3}, "policy": {"optimizer": {"kwargs": {"lr": 1e-6}}}}


def _cfg(tmp_path: Path, **overrides) -> dict:
    return {"log_dir": str(tmp_path / "run"), "tensorboard_enabled": False, "plot_enabled": False, **overrides}


def _log_a_run(logger: MetricsLogger, steps=(1, 2, 3)) -> None:
    """What a GRPO loop logs: validation at step 0 and at the last step, train rows between."""
    logger.log("val", 0, {"accuracy": 0.25})
    for step in steps:
        logger.log("train", step, {"loss": 1.0 / step, "reward_mean": 0.1 * step, "timing": {"train_s": 0.5}})
    logger.log("val", steps[-1], {"accuracy": 0.75})


def _jsonl_points(metrics_path: Path) -> set[tuple[str, int, float]]:
    """(``<split>/<metric>``, step, value) of every metric of every metrics.jsonl row."""
    return {
        (f"{row['split']}/{name}", row["step"], value)
        for row in read_metrics(metrics_path)
        for name, value in row.items()
        if name not in ("step", "split", "time")
    }


# ----------------------------------------------------------------------------- config, missing packages


def test_trackers_are_off_by_default_and_their_sections_are_strict(tmp_path):
    cfg = LoggerConfig.coerce(_cfg(tmp_path), "logger")
    assert not cfg.wandb_enabled and not cfg.mlflow_enabled
    assert cfg.wandb.project is None and cfg.mlflow.experiment_name == "dualrl"
    with pytest.raises(ConfigError, match=r"^logger\.wandb\.projet: unknown key \(did you mean 'project'\?\)$"):
        LoggerConfig.coerce(_cfg(tmp_path, wandb={"projet": "x"}), "logger")
    with pytest.raises(ConfigError, match=r"^logger\.mlflow\.tracking_uri: "):
        LoggerConfig.coerce(_cfg(tmp_path, mlflow={"tracking_uri": ""}), "logger")


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_an_enabled_tracker_without_its_package_is_refused_before_anything_starts(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import wandb` sees where it is not installed
    switch = f"{package}_enabled"
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "split": "train", "loss": 1.0}\n')

    (line,) = tracker_package_errors(LoggerConfig.coerce(_cfg(tmp_path, **{switch: True}), "logger"))
    assert line.startswith(f"logger.{switch}: True needs the '{package}' package, which cannot be imported")
    assert line.endswith(f"pip install 'dualrl[{package}]', or set logger.{switch}=false")
    with pytest.raises(ConfigError, match=rf"^logger\.{switch}: .*pip install 'dualrl\[{package}\]'"):
        MetricsLogger(_cfg(tmp_path, **{switch: True}))
    assert read_metrics(metrics)[0]["loss"] == 1.0  # refused before the fresh run truncated the file
    assert tracker_package_errors(LoggerConfig.coerce(_cfg(tmp_path), "logger")) == []  # off: not imported


def test_the_cli_config_check_refuses_a_missing_tracker_naming_the_override(monkeypatch):
    from dualrl.cli import load_command_config

    monkeypatch.setitem(sys.modules, "wandb", None)
    # --backend jax_pjit: its preflight imports no optimizer class, so the test needs no torch.
    args = argparse.Namespace(
        command="grpo",
        config=str(EMBEDDED_CONFIGS["grpo"]),
        overrides=["logger.wandb_enabled=true"],
        backend="jax_pjit",
    )
    with pytest.raises(ConfigError) as info:
        load_command_config(args)
    (line,) = info.value.errors
    assert line.startswith("logger.wandb_enabled: True needs the 'wandb' package")
    assert line.endswith("(from override 'logger.wandb_enabled=true')")


# ----------------------------------------------------------------------------- Weights & Biases (offline)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B without a network: offline mode, its files under tmp_path, no console capture."""
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    return wandb_dir


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline run's ``run-<id>.wandb`` file.

    The file is a ":W&B" header (magic, version: 7 bytes) then LevelDB-log blocks of 32 KiB:
    each chunk is crc32, length, type (FULL=1, FIRST=2, MIDDLE=3, LAST=4) and its bytes; a
    block's last 6 bytes or fewer are padding.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending, pos = run_file.read_bytes(), 32768, [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail cannot hold a chunk header
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_records(run_file: Path, timeout_s: float = 10.0) -> list:
    """The records once the run's exit record is on disk: ``run.finish()`` returns before
    wandb's service process has written the offline file."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(run_file) if run_file.is_file() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _wandb_run(wandb_dir: Path, run_id: str, nth: int = 0) -> dict:
    """The run id, config, history points and exit code of one offline run directory."""
    dirs = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(dirs) > nth, sorted(wandb_dir.rglob("*"))
    records = _finished_records(dirs[nth] / f"run-{run_id}.wandb")
    out: dict = {"points": set(), "config": {}, "exit_code": None, "run_id": None}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":  # the config passed to wandb.init comes with the run
            out["run_id"] = record.run.run_id
            out["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            out["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = row.pop("_step")
            out["points"] |= {(key, step, value) for key, value in row.items() if not key.startswith("_")}
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def test_wandb_history_and_config_match_the_jsonl_rows(tmp_path, wandb_offline):
    cfg = _cfg(tmp_path, wandb_enabled=True, wandb={"project": "dualrl-tests", "name": "offline"})
    with MetricsLogger(cfg, run_config=RUN_CONFIG) as logger:
        _log_a_run(logger)
    run_id = (logger.log_dir / WANDB_RUN_ID_FILENAME).read_text().strip()
    run = _wandb_run(wandb_offline, run_id)
    assert run["run_id"] == run_id and run["exit_code"] == 0
    jsonl = _jsonl_points(logger.metrics_path)
    assert ("train/timing/train_s", 2, 0.5) in jsonl and ("val/accuracy", 3, 0.75) in jsonl
    assert run["points"] == jsonl  # the same names, steps and values as metrics.jsonl (and TensorBoard)
    assert {key: run["config"][key] for key in RUN_CONFIG} == RUN_CONFIG
    assert not (logger.log_dir / "wandb").exists()  # WANDB_DIR wins over log_dir


def test_wandb_resume_continues_the_run_and_a_failure_is_its_exit_code(tmp_path, wandb_offline):
    cfg = _cfg(tmp_path, wandb_enabled=True)
    with pytest.raises(RuntimeError, match="engine died"):
        with MetricsLogger(cfg, run_config=RUN_CONFIG) as crashed:
            _log_a_run(crashed, steps=(1, 2))
            raise RuntimeError("engine died")
    run_id = (crashed.log_dir / WANDB_RUN_ID_FILENAME).read_text().strip()
    assert _wandb_run(wandb_offline, run_id)["exit_code"] == 1

    with MetricsLogger(cfg, resume=True, run_config=RUN_CONFIG) as resumed:
        resumed.truncate_after(1)
        resumed.log("train", 2, {"loss": 0.25})
    continued = _wandb_run(wandb_offline, run_id, nth=1)  # offline: a second directory, the same run id
    assert continued["run_id"] == run_id and continued["exit_code"] == 0
    assert continued["points"] == {("train/loss", 2, 0.25)}

    with MetricsLogger(cfg, run_config=RUN_CONFIG):  # a fresh run (no --resume): a new W&B run
        pass
    assert (crashed.log_dir / WANDB_RUN_ID_FILENAME).read_text().strip() != run_id


# ----------------------------------------------------------------------------- MLflow (file store)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A file store under tmp_path (MLflow 3 wants its opt-in for the file backend)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file://{tmp_path / 'mlruns'}"


def _mlflow_points(client, run_id: str) -> set[tuple[str, int, float]]:
    run = client.get_run(run_id)
    return {(m.key, m.step, m.value) for key in run.data.metrics for m in client.get_metric_history(run_id, key)}


def test_mlflow_metrics_and_params_match_the_jsonl_rows(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    mlflow_cfg = {"experiment_name": "dualrl-tests", "run_name": "file-store", "tracking_uri": mlflow_store}
    with MetricsLogger(_cfg(tmp_path, mlflow_enabled=True, mlflow=mlflow_cfg), run_config=RUN_CONFIG) as logger:
        _log_a_run(logger)
        logger.log("train", 4, {"loss": math.nan})  # a diverged loss stays visible
    client = MlflowClient(tracking_uri=mlflow_store)
    run = client.get_run((logger.log_dir / MLFLOW_RUN_ID_FILENAME).read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "file-store"
    assert client.get_experiment(run.info.experiment_id).name == "dualrl-tests"
    points = _mlflow_points(client, run.info.run_id)
    (nan_point,) = [p for p in points if p[1] == 4]
    assert nan_point[0] == "train/loss" and math.isnan(nan_point[2])
    jsonl = {p for p in _jsonl_points(logger.metrics_path) if p[1] != 4}
    assert points - {nan_point} == jsonl  # the same names, steps and values as metrics.jsonl
    assert {k: run.data.params[k] for k in ("grpo.seed", "grpo.max_num_steps", "policy.optimizer.kwargs.lr")} == {
        "grpo.seed": "7",
        "grpo.max_num_steps": "3",
        "policy.optimizer.kwargs.lr": "1e-06",
    }


def test_mlflow_resume_continues_the_run_and_keeps_its_first_params(tmp_path, mlflow_store, caplog):
    from mlflow.tracking import MlflowClient

    cfg = _cfg(tmp_path, mlflow_enabled=True, mlflow={"tracking_uri": mlflow_store})
    with pytest.raises(RuntimeError, match="engine died"):
        with MetricsLogger(cfg, run_config=RUN_CONFIG) as crashed:
            _log_a_run(crashed, steps=(1, 2))
            raise RuntimeError("engine died")
    client = MlflowClient(tracking_uri=mlflow_store)
    run_id = (crashed.log_dir / MLFLOW_RUN_ID_FILENAME).read_text().strip()
    assert client.get_run(run_id).info.status == "FAILED"

    longer = {**RUN_CONFIG, "grpo": {"seed": 7, "max_num_steps": 5}}  # resumed with more steps
    with caplog.at_level(logging.WARNING, logger="core.logging.mlflow_sink"):
        with MetricsLogger(cfg, resume=True, run_config=longer) as resumed:
            assert client.get_run(run_id).info.status == "RUNNING"
            resumed.truncate_after(1)
            resumed.log("train", 2, {"loss": 0.25})
    assert "keeps its first values of params ['grpo.max_num_steps']" in caplog.text
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["grpo.max_num_steps"] == "3"
    # MLflow cannot forget the interrupted run's step 2: both values are there.
    assert {(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")} == {
        (1, 1.0),
        (2, 0.5),
        (2, 0.25),
    }


# ----------------------------------------------------------------------------- a failed run


def test_a_training_command_that_raises_closes_its_run_as_failed(tmp_path):
    """``execute`` (what ``dualrl grpo|sft|dpo`` runs) tells the run it failed, so the
    trackers' runs end failed rather than finished."""
    from core.algorithms.training_run import execute
    from core.datasets import PromptDatum
    from tests.grpo_runs import SMALL, grpo_run

    run = grpo_run(tmp_path, [PromptDatum("1+1=", (1, 5), {}), PromptDatum("2+2=", (1, 6), {})], *SMALL)

    def train(run):
        raise RuntimeError("reward function raised")

    with pytest.raises(RuntimeError, match="reward function raised"):
        execute(lambda: run, train, lambda run: {})
    assert run.failed is True
