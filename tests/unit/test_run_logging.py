"""core.logging: JSONL/TensorBoard sinks, MetricsLogger, progress bar, plots and summary."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from core.config import ConfigError
from core.logging import (
    JsonlSink,
    MetricsLogger,
    StepProgress,
    TensorBoardSink,
    format_summary,
    format_val_samples,
    plot_run,
    read_metrics,
    to_float,
)
from core.logging.plots import DPI, FIGSIZE
from tests.logs import warns


def _cfg(tmp_path, **overrides):
    return {"log_dir": str(tmp_path / "run"), "tensorboard_enabled": False, **overrides}


def _history(n_steps=20, val_period=5, timing=True):
    """A GRPO-like history: rewards rising, val every ``val_period`` steps from step 0."""
    rows = []
    for step in range(0, n_steps + 1):
        if step % val_period == 0:
            rows.append({"step": step, "split": "val", "accuracy": 0.2 + 0.02 * step, "reward_mean": 0.1 + 0.02 * step})
        if step == 0:
            continue
        row = {"step": step, "split": "train", "reward_mean": step / n_steps, "loss": 1.0 / step, "step_time_s": 4.0}
        if timing:
            row.update(
                {"timing/generation_s": 2.0, "timing/logprobs_s": 0.5, "timing/train_s": 1.0, "timing/refit_s": 0.5}
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- to_float / JSONL


def test_to_float_accepts_scalars_only():
    assert to_float(3) == 3.0 and to_float(True) == 1.0 and to_float(2.5) == 2.5
    assert to_float(np.float32(1.5)) == 1.5 and to_float(np.array(7)) == 7.0
    assert to_float(torch.tensor(0.25)) == 0.25
    for bad in ([1.0], "1.0", None, np.ones(2), torch.ones(1), {"a": 1}, 1 + 2j):
        assert to_float(bad) is None, bad


def test_jsonl_round_trip_keeps_non_finite_and_tensor_values(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"  # parent created by the sink
    sink = JsonlSink(path, append=False)
    sink.write("train", 1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": np.float64(0.5), "e": torch.tensor(2.0)})
    sink.write("val", 2, {"accuracy": 0.75})
    sink.close()
    raw = path.read_text().splitlines()
    assert json.loads(raw[0])["a"] == "nan" and json.loads(raw[0])["c"] == "-inf"  # valid JSON, visible value
    rows = read_metrics(path)
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "val")]
    assert math.isnan(rows[0]["a"]) and rows[0]["b"] == math.inf and rows[0]["c"] == -math.inf
    assert rows[0]["d"] == 0.5 and rows[0]["e"] == 2.0 and rows[1]["accuracy"] == 0.75
    assert isinstance(rows[0]["time"], float)


def test_jsonl_lines_are_flushed_while_sink_is_open(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, append=False)
    sink.write("train", 1, {"loss": 1.0})
    assert [r["loss"] for r in read_metrics(path)] == [1.0]
    sink.write("train", 2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    sink.close()


def test_jsonl_rejects_reserved_and_non_numeric_metrics(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl", append=False)
    with pytest.raises(ValueError, match="'step' is reserved"):
        sink.write("train", 1, {"step": 3.0})
    with pytest.raises(TypeError, match="metric 'x'"):
        sink.write("train", 1, {"x": "abc"})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        sink.write("train", -1, {"x": 1.0})
    sink.close()


def test_truncated_last_line_is_skipped_with_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "split": "tr')
    with warns(caplog, "truncated last line 2"):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\nnot json\n{"step": 3, "split": "train"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2: invalid JSON"):
        read_metrics(path)
    # A complete (newline-terminated) bad last line is not a crash artefact: also an error.
    path.write_text('{"step": 1, "split": "train"}\n{"split": "train"}\n')
    with pytest.raises(ValueError, match="line 2: missing or non-integer 'step'"):
        read_metrics(path)


def test_append_keeps_rows_and_repairs_partial_line_truncate_does_not_keep(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        f.write('{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "spl')  # crash mid-write
    with warns(caplog, "partial last line"):
        sink = JsonlSink(path, append=True)
    sink.write("train", 2, {"loss": 0.5})
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # no malformed line in the middle
    JsonlSink(path, append=False).close()
    assert read_metrics(path) == []


# --------------------------------------------------------------------------- MetricsLogger


def test_metrics_logger_converts_drops_and_keeps_history(tmp_path):
    with MetricsLogger(_cfg(tmp_path)) as logger:
        logger.log(
            "train",
            1,
            {
                "loss": torch.tensor(0.5),
                "reward_mean": np.float32(0.25),
                "n": 3,
                "texts": ["a"],
                "name": "x",
                "none": None,
                "timing": {"train_s": 1.5},
            },
        )
        logger.log("val", 1, {"accuracy": 1.0})
    rows = read_metrics(logger.metrics_path)
    assert [{k: v for k, v in r.items() if k != "time"} for r in rows] == [
        {"step": 1, "split": "train", "loss": 0.5, "reward_mean": 0.25, "n": 3.0, "timing/train_s": 1.5},
        {"step": 1, "split": "val", "accuracy": 1.0},
    ]
    assert rows == logger.history
    assert not (logger.log_dir / "tensorboard").exists()
    with pytest.raises(ValueError, match="is closed"):
        logger.log("train", 2, {"loss": 1.0})


def test_metrics_logger_config_errors_name_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^logger\.tensorbord_enabled: unknown key \(did you mean 'tensorboard_enabled'\?\)$"
    ):
        MetricsLogger({"log_dir": str(tmp_path), "tensorbord_enabled": False})
    with pytest.raises(ConfigError, match=r"^logger\.log_dir: missing required key$"):
        MetricsLogger({"jsonl_enabled": True})
    with pytest.raises(ConfigError, match=r"^logger\.jsonl_enabled: expected bool, got str \('yes'\)$"):
        MetricsLogger(_cfg(tmp_path, jsonl_enabled="yes"))


def test_resume_appends_and_truncate_after_drops_later_steps(tmp_path):
    with MetricsLogger(_cfg(tmp_path)) as first:
        for step in range(1, 6):
            first.log("train", step, {"loss": float(step)})
        first.log("val", 5, {"accuracy": 0.5})
    # Resuming from the checkpoint at step 3: steps 4, 5 (train and val) will be run again.
    with MetricsLogger(_cfg(tmp_path), resume=True) as resumed:
        resumed.truncate_after(3)
        assert [r["step"] for r in read_metrics(resumed.metrics_path)] == [1, 2, 3]
        resumed.log("train", 4, {"loss": 40.0})
    rows = read_metrics(resumed.metrics_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert not list(resumed.log_dir.glob("*.tmp"))  # the atomic rewrite left no temp file
    with MetricsLogger(_cfg(tmp_path)) as fresh:  # not resuming: the file starts over
        fresh.log("train", 1, {"loss": 9.0})
    assert [r["loss"] for r in read_metrics(fresh.metrics_path)] == [9.0]


def _tb_scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_sink_scalars_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write("train", 1, {"loss": 0.5, "reward_mean": torch.tensor(0.25), "note": "skip me", "v": [1, 2]})
    sink.write("train", 2, {"loss": 0.25, "reward_mean": 0.75})
    sink.write("val", 2, {"accuracy": np.float32(0.5)})
    sink.close()
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    assert _tb_scalars(tb_dir, "train/loss") == [(1, 0.5), (2, 0.25)]
    assert _tb_scalars(tb_dir, "train/reward_mean") == [(1, 0.25), (2, 0.75)]
    assert _tb_scalars(tb_dir, "val/accuracy") == [(2, 0.5)]


def test_metrics_logger_tensorboard_truncate_after_purges_later_events(tmp_path):
    cfg = _cfg(tmp_path, tensorboard_enabled=True)
    with MetricsLogger(cfg) as first:
        for step in (1, 2, 3):
            first.log("train", step, {"loss": float(step)})
    with MetricsLogger(cfg, resume=True) as resumed:
        resumed.truncate_after(1)
        resumed.log("train", 2, {"loss": 20.0})
    assert _tb_scalars(resumed.tensorboard_dir, "train/loss") == [(1, 1.0), (2, 20.0)]


# --------------------------------------------------------------------------- progress bar


def test_progress_postfix_shows_metrics_on_stderr(capsys):
    bar = StepProgress(3, desc="grpo")
    bar.update(1, {"reward_mean": 0.51234, "loss": torch.tensor(0.012345), "step_time_s": 4.2})
    bar.update(1, {"val/accuracy": 0.75})  # validation at the same step: postfix only
    bar.update(2, {"reward_mean": 0.625, "loss": 0.0111})
    bar.close()
    err = capsys.readouterr().err
    assert "grpo" in err and "2/3" in err
    assert "reward=0.625" in err and "loss=0.0111" in err and "val_accuracy=0.75" in err and "s/step=4.2" in err
    with pytest.raises(ValueError, match="went backwards"):
        StepProgress(3, initial=2, enabled=False).update(1, {})


def test_progress_disabled_prints_via_write_and_no_bar(capsys):
    bar = StepProgress(5, enabled=False)
    bar.update(1, {"reward_mean": 0.5})
    bar.write("validation done")
    bar.close()
    out, err = capsys.readouterr()
    assert out == "validation done\n" and err == ""


def test_progress_enabled_write_goes_to_stdout(capsys):
    bar = StepProgress(2)
    bar.write("hello")
    bar.close()
    assert "hello" in capsys.readouterr().out


# --------------------------------------------------------------------------- plots


def _check_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))


def test_plot_run_full_history(tmp_path):
    history = _history()
    history[3]["loss"] = math.inf  # a diverged value must not break the axes
    out = plot_run(history, tmp_path / "plots" / "curves.png", title="grpo arithmetic")
    assert out == tmp_path / "plots" / "curves.png"
    _check_png(out)


def test_plot_run_partial_histories(tmp_path):
    # Only train rows without timing; only val rows; rewards outside [0, 1] (twin axis).
    no_val = [r for r in _history(timing=False) if r["split"] == "train"]
    only_val = [r for r in _history() if r["split"] == "val"]
    wide = [{**r, "reward_mean": 10 * r.get("reward_mean", 0)} for r in _history(n_steps=6, val_period=3)]
    for i, history in enumerate((no_val, only_val, wide, [{"step": 1, "split": "train"}])):
        _check_png(plot_run(history, tmp_path / f"p{i}.png"))


def test_plot_run_rejects_empty_history_and_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match="empty history"):
        plot_run([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="must end in .png"):
        plot_run(_history(), tmp_path / "x.jpg")


# --------------------------------------------------------------------------- summary


def test_format_summary_accuracy_and_timing(tmp_path):
    history = _history(n_steps=20, val_period=5)
    last_val = next(r for r in reversed(history) if r["split"] == "val")
    last_val["accuracy"] = 0.3  # the last val (step 20) is worse than the best (step 15)
    history[-1]["grad_norm"] = 1.25
    text = format_summary(history, wall_time_s=125.0, run_dir=tmp_path, extra={"backend": "jax_pjit"})
    lines = text.splitlines()
    assert lines[0] == "backend: jax_pjit" and len(lines) <= 25
    assert "steps run: 20 (steps 1..20)" in text and "wall time: 2m 05s" in text
    assert "val accuracy: first 0.200 (step 0) -> last 0.300 (step 20) -> best 0.500 (step 15)" in text
    assert "val reward mean: first 0.100 (step 0)" in text
    assert "train reward mean: first 10% 0.075 -> last 10% 0.975 (2 step(s) each)" in text
    assert "seconds per step: 4 (mean over 20 steps)" in text
    assert "grad_norm 1.25" in text and "loss 0.05" in text
    shares = [float(p) for p in re.findall(r"(\d+(?:\.\d+)?)%", text.split("time by phase")[1].splitlines()[0])]
    assert len(shares) == 4 and abs(sum(shares) - 100.0) < 0.5
    assert "generation 50.0%" in text
    assert str(tmp_path / "metrics.jsonl") in text and "(not written)" in text


def test_format_summary_without_validation_or_timing(tmp_path):
    history = [{"step": s, "split": "train", "reward_mean": 0.5} for s in (1, 2)]
    text = format_summary(history, wall_time_s=10.0, run_dir=tmp_path)
    assert "validation: none run" in text and "seconds per step: 5 (wall time / steps)" in text
    assert "time by phase" not in text


def test_format_val_samples():
    samples = [
        {"prompt": "1+1=", "completion": "2", "reward": 1.0, "ground_truth": "2"},
        {"prompt": "2+2=", "completion": "x" * 1000, "reward": 0.0},
        {"prompt": "3+3=", "completion": "6"},
    ]
    text = format_val_samples(samples, 2)
    assert "1+1=" in text and "reward 1" in text and "ground truth '2'" in text
    assert "2+2=" in text and "[1000 chars]" in text and "3+3=" not in text
    assert format_val_samples(samples, 0) == ""
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['completion'\]"):
        format_val_samples([{"prompt": "p"}], 1)


# --------------------------------------------------------------------------- import cost


def test_import_pulls_no_heavy_frameworks():
    code = (
        "import sys, core.logging; "
        "print([m for m in ('torch', 'jax', 'ray', 'matplotlib', 'tensorboard') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
