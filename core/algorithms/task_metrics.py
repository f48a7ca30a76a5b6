"""Metrics per task of a task mix: the same metrics again over each task's samples.

A sample's task is what its environment says (``info["task"]``: the reasoning_gym environment
names the reasoning-gym task of every row); an environment that names none gets no per-task
metrics.  Every per-task metric is logged as ``tasks/<task>/<metric>``
(:func:`core.logging.progress.task_metric`), which the progress bar, the end-of-run summary,
``curves.png`` and ``dualrl eval``'s report read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.logging.progress import task_metric

#: The info key that names a sample's task.
TASK_INFO_KEY = "task"


def sample_tasks(infos: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """Each sample's task, or None unless the environment named one for every sample."""
    tasks = [info.get(TASK_INFO_KEY) for info in infos]
    return tasks if tasks and all(isinstance(t, str) for t in tasks) else None  # type: ignore[return-value]


def rows_by_task(tasks: Sequence[str]) -> dict[str, list[int]]:
    """Task -> the indices of its samples, tasks in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        out.setdefault(task, []).append(i)
    return out


def split_by_task(per_sample: Mapping[str, Sequence[float]], tasks: Sequence[str]) -> dict[str, dict[str, list[float]]]:
    """``{metric: one value per sample}`` -> ``{task: {metric: that task's values}}``."""
    return {
        task: {name: [values[i] for i in rows] for name, values in per_sample.items()}
        for task, rows in rows_by_task(tasks).items()
    }


def train_task_metrics(infos: Sequence[Mapping[str, Any]], rewards: Sequence[float]) -> dict[str, float]:
    """A rollout batch's ``tasks/<task>/reward_mean``, ``.../accuracy`` (when the environment
    says which samples are correct) and ``.../share`` (the task's fraction of the samples)."""
    tasks = sample_tasks(infos)
    if tasks is None:
        return {}
    per_sample: dict[str, list[float]] = {"reward_mean": [float(r) for r in rewards]}
    if all("correct" in info for info in infos):
        per_sample["accuracy"] = [float(bool(info["correct"])) for info in infos]
    out: dict[str, float] = {}
    for task, values in split_by_task(per_sample, tasks).items():
        for name, task_values in values.items():
            out[task_metric(task, name)] = sum(task_values) / len(task_values)
        out[task_metric(task, "share")] = len(values["reward_mean"]) / len(tasks)
    return out
