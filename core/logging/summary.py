"""The end-of-run text summary and the validation-sample printout.

Both return strings: the loop prints them (through ``StepProgress.write`` while a bar is
on screen) and may also save them next to the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.logging.progress import STEP_TIME_KEYS, task_metric, tasks_in, timing_keys_in
from core.logging.sinks import METRICS_FILENAME, PLOT_FILENAME, TENSORBOARD_DIRNAME, to_float

# Train metrics reported as their last value, when present.
LAST_VALUE_KEYS = ("loss", "grad_norm", "lr", "token_mult_prob_error")

# Validation samples are cut to this many characters per field: one screen, not a dump.
MAX_SAMPLE_CHARS = 400


def _values(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in ``rows`` where it is a finite number."""
    out = []
    for row in rows:
        number = to_float(row.get(key))
        if number is not None and math.isfinite(number):
            out.append((int(row["step"]), number))
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def format_duration(seconds: float) -> str:
    """``42.0s``, ``3m 05s`` or ``1h 02m 03s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _first_last_best(name: str, points: list[tuple[int, float]], lower_is_better: bool = False) -> str:
    """``name: first 0.250 (step 0) -> last 0.600 (step 20) -> best 0.650 (step 15)``."""
    (s0, v0), (s1, v1) = points[0], points[-1]
    pick = min if lower_is_better else max
    sb, vb = pick(points, key=lambda p: p[1])  # the earliest step among ties
    return f"{name}: first {v0:.3f} (step {s0}) -> last {v1:.3f} (step {s1}) -> best {vb:.3f} (step {sb})"


def _train_trend_line(train: Sequence[Mapping[str, Any]], key: str, name: str) -> str | None:
    """A train metric's mean over the first 10 % of steps vs the last 10 %."""
    points = _values(train, key)
    if not points:
        return None
    k = max(1, math.ceil(len(points) / 10))
    first, last = _mean([v for _, v in points[:k]]), _mean([v for _, v in points[-k:]])
    return f"{name}: first 10% {first:.3f} -> last 10% {last:.3f} ({k} step(s) each)"


def _task_lines(rows: Sequence[Mapping[str, Any]], metric: str, name: str, trend: bool = False) -> list[str]:
    """One line per task of a mix: its ``metric`` first -> last -> best, or (``trend``) its mean
    over the first vs the last 10 % of steps."""
    lines = []
    for task in tasks_in(rows, metric):
        label = f"  {task}: {name}"
        if trend:
            line = _train_trend_line(rows, task_metric(task, metric), label)
        else:
            points = _values(rows, task_metric(task, metric))
            line = _first_last_best(label, points) if points else None
        lines += [line] if line else []
    return lines


def _timing_lines(train: Sequence[Mapping[str, Any]], wall_time_s: float, n_steps: int) -> list[str]:
    """Mean seconds per step, and each phase's share of the summed phase times."""
    lines = []
    step_times = next((pts for key in STEP_TIME_KEYS if (pts := _values(train, key))), [])
    if step_times:
        lines.append(f"seconds per step: {_mean([v for _, v in step_times]):.3g} (mean over {len(step_times)} steps)")
    elif n_steps:
        lines.append(f"seconds per step: {wall_time_s / n_steps:.3g} (wall time / steps)")
    means = {}
    for key in timing_keys_in(train):
        points = _values(train, key)
        if points:
            means[key.removeprefix("timing/").removesuffix("_s")] = _mean([v for _, v in points])
    total = sum(means.values())
    if total > 0:
        parts = [f"{name} {100 * sec / total:.1f}%" for name, sec in means.items()]
        lines.append(f"time by phase ({total:.3g} s/step): " + ", ".join(parts))
    return lines


def _last_values_line(train: Sequence[Mapping[str, Any]]) -> str | None:
    """Last finite value of each LAST_VALUE_KEYS metric present."""
    parts = [f"{key} {points[-1][1]:.4g}" for key in LAST_VALUE_KEYS if (points := _values(train, key))]
    return "last train: " + ", ".join(parts) if parts else None


def _path_lines(run_dir: Path) -> list[str]:
    """The run's output files, each marked when it was not written."""
    lines = []
    for label, path in (
        ("metrics", run_dir / METRICS_FILENAME),
        ("tensorboard", run_dir / TENSORBOARD_DIRNAME),
        ("plot", run_dir / PLOT_FILENAME),
    ):
        lines.append(f"  {label + ':':<13}{path}" + ("" if path.exists() else "  (not written)"))
    return lines


def format_summary(
    history: Sequence[Mapping[str, Any]],
    *,
    wall_time_s: float,
    run_dir: Path | str,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """One screen of plain text describing a finished run.

    ``history`` is the rows of the run (``MetricsLogger.history``, or ``read_metrics`` of
    metrics.jsonl to cover a resumed run's earlier steps too); ``extra`` items (backend,
    model, ...) come first as ``key: value`` lines.
    """
    train = [row for row in history if row.get("split") == "train"]
    val = [row for row in history if row.get("split") == "val"]
    train_steps = sorted({int(row["step"]) for row in train})
    lines = [f"{key}: {value}" for key, value in (extra or {}).items()]
    span = f" (steps {train_steps[0]}..{train_steps[-1]})" if train_steps else ""
    lines.append(f"steps run: {len(train_steps)}{span}")
    lines.append(f"wall time: {format_duration(wall_time_s)}")
    if accuracy := _values(val, "accuracy"):
        lines.append(_first_last_best("val accuracy", accuracy))
    lines += _task_lines(val, "accuracy", "val accuracy")
    if val_reward := _values(val, "reward_mean"):
        lines.append(_first_last_best("val reward mean", val_reward))
    if val_loss := _values(val, "loss"):
        lines.append(_first_last_best("val loss", val_loss, lower_is_better=True))
    if not val:
        lines.append("validation: none run")
    # RL runs are judged by their reward (their loss is a surrogate); SFT / DPO by loss and accuracy.
    trends = (
        (("reward_mean", "train reward mean"),)
        if _values(train, "reward_mean")
        else (("accuracy", "train accuracy"), ("loss", "train loss"))
    )
    lines += [line for key, name in trends if (line := _train_trend_line(train, key, name))]
    lines += _task_lines(train, "reward_mean", "train reward mean", trend=True)
    lines += [line for line in (_last_values_line(train),) if line]
    lines += _timing_lines(train, wall_time_s, len(train_steps))
    lines.append("files:")
    lines += _path_lines(Path(run_dir))
    return "\n".join(lines)


def _clip(text: str) -> str:
    """Shorten ``text`` to MAX_SAMPLE_CHARS, marking the cut."""
    return text if len(text) <= MAX_SAMPLE_CHARS else text[:MAX_SAMPLE_CHARS] + f" ... [{len(text)} chars]"


def format_val_samples(samples: Sequence[Mapping[str, Any]], n: int) -> str:
    """The first ``n`` validation examples: prompt, completion, reward and ground truth.

    Each sample needs "prompt" and "completion"; "reward" and "ground_truth" are shown
    when present.  Long fields are clipped to MAX_SAMPLE_CHARS.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"format_val_samples: n must be an int >= 0, got {n!r}")
    blocks = []
    shown = list(samples)[:n]
    for i, sample in enumerate(shown):
        missing = [key for key in ("prompt", "completion") if key not in sample]
        if missing:
            raise ValueError(f"validation sample {i} lacks key(s) {missing}; it has {sorted(sample)}")
        header = [f"--- validation sample {i + 1}/{len(shown)}"]
        if (reward := to_float(sample.get("reward"))) is not None:
            header.append(f"reward {reward:.3g}")
        if sample.get("ground_truth") is not None:
            header.append(f"ground truth {_clip(str(sample['ground_truth']))!r}")
        blocks.append(
            "\n".join(
                [
                    " | ".join(header) + " ---",
                    f"prompt:     {_clip(str(sample['prompt']))}",
                    f"completion: {_clip(str(sample['completion']))}",
                ]
            )
        )
    return "\n".join(blocks)
