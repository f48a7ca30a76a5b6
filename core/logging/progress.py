"""A tqdm bar over training steps, and the metric names the loop, bar, plots and summary share.

The loops log metrics under the names below; the bar, :mod:`core.logging.plots` and
:mod:`core.logging.summary` look for these names, so this module is the one place to
change when a loop renames a metric.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from core.logging.sinks import to_float

# Display name on the bar -> metric keys that can supply it, first present wins.
# "reward" is the train reward mean of the step; "val_accuracy" arrives only on
# validation steps (the loop passes it as "val/accuracy"), so the bar keeps showing the
# last value it saw; "s/step" is the wall time of the whole step.
PROGRESS_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "train/reward_mean", "reward")),
    ("val_accuracy", ("val/accuracy", "val_accuracy")),
    ("loss", ("loss", "train/loss")),
    ("val_loss", ("val/loss",)),
    ("margin", ("reward_margin",)),  # DPO: chosen - rejected implicit reward
    ("s/step", ("step_time_s", "timing/step_s", "timing/total_s")),
)

# Keys that hold the wall time of a whole step (the "s/step" candidates above).
STEP_TIME_KEYS: tuple[str, ...] = dict(PROGRESS_FIELDS)["s/step"]

# Per-phase timings of a step (GRPO's all; SFT train; DPO reference + train), in pipeline order; plots stack them
# and the summary reports each as a share of their sum, so they must not overlap one another.
TIMING_KEYS: tuple[str, ...] = (
    "timing/generation_s",
    "timing/reward_s",
    "timing/reference_s",
    "timing/logprobs_s",
    "timing/train_s",
    "timing/refit_s",
)


#: Per-task metrics (a task mix whose environment names each sample's task, e.g. reasoning_gym):
#: ``tasks/<task>/<metric>``, the same metric computed over that task's samples only.
TASK_METRIC_PREFIX = "tasks/"


def task_metric(task: str, metric: str) -> str:
    """``tasks/<task>/<metric>``."""
    return f"{TASK_METRIC_PREFIX}{task}/{metric}"


def task_metric_parts(key: str) -> tuple[str, str] | None:
    """``(task, metric)`` of a per-task metric's key (any split prefix such as ``val/`` ignored),
    else None."""
    _, found, rest = key.partition(TASK_METRIC_PREFIX)
    task, slash, metric = rest.partition("/")
    return (task, metric) if found and slash and task and metric else None


def tasks_in(rows: Any, metric: str) -> list[str]:
    """The tasks that have a per-task ``metric`` in ``rows``, in order of first appearance."""
    tasks: dict[str, None] = {}
    for row in rows:
        for key in row:
            parts = task_metric_parts(key)
            if parts is not None and parts[1] == metric:
                tasks.setdefault(parts[0])
    return list(tasks)


def timing_keys_in(rows: Any) -> list[str]:
    """The phase-timing keys present in ``rows``: TIMING_KEYS first, then other ``timing/*_s``.

    Whole-step totals (STEP_TIME_KEYS) are left out: they would count every phase twice.
    """
    present = {key for row in rows for key in row if key.startswith("timing/") and key.endswith("_s")}
    present -= set(STEP_TIME_KEYS)
    return [k for k in TIMING_KEYS if k in present] + sorted(present - set(TIMING_KEYS))


def format_postfix(values: Mapping[str, float]) -> str:
    """``reward=0.512, loss=0.0123`` in PROGRESS_FIELDS order, then per-task values, 3
    significant digits."""
    order = [name for name, _ in PROGRESS_FIELDS]
    order += [name for name in values if name not in order]
    return ", ".join(f"{name}={values[name]:.3g}" for name in order if name in values)


def pick_progress_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The PROGRESS_FIELDS display values that ``metrics`` can supply, then each task's
    validation accuracy (``val/tasks/<task>/accuracy``) under the task's name."""
    picked: dict[str, float] = {}
    for display, candidates in PROGRESS_FIELDS:
        for key in candidates:
            number = to_float(metrics.get(key))
            if number is not None:
                picked[display] = number
                break
    for key, value in metrics.items():
        parts = task_metric_parts(key)
        number = to_float(value)
        if key.startswith("val/") and parts is not None and parts[1] == "accuracy" and number is not None:
            picked[parts[0]] = number
    return picked


class StepProgress:
    """A progress bar over training steps, on stderr, with the latest key metrics."""

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True, desc: str = "grpo") -> None:
        """``initial`` = steps already done (a resumed run); ``enabled=False`` shows nothing."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an int >= 0, got {total_steps!r}")
        if isinstance(initial, bool) or not isinstance(initial, int) or not 0 <= initial <= total_steps:
            raise ValueError(f"initial must be an int in [0, total_steps={total_steps}], got {initial!r}")
        self.enabled = enabled
        self.values: dict[str, float] = {}
        # file=sys.stderr read now (not at import) so a redirected stderr is honoured.
        self._bar = tqdm(
            total=total_steps,
            initial=initial,
            desc=desc,
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
            unit="step",
        )
        self._n = initial

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Advance to ``step`` finished steps and show the metrics of PROGRESS_FIELDS present.

        Calling it again for the same step (e.g. after validation) only updates the postfix.
        """
        if step < self._n:
            raise ValueError(f"progress step went backwards: {step} < {self._n}")
        self.values.update(pick_progress_values(metrics))
        self._bar.set_postfix_str(format_postfix(self.values), refresh=False)
        if step > self._n:
            self._bar.update(step - self._n)  # rate-limited redraw (tqdm's mininterval)
        else:
            self._bar.refresh()  # same step again (validation): show its new values now
        self._n = step

    def write(self, text: str) -> None:
        """Print a line (to stdout) without breaking the bar; a plain print when disabled."""
        if self.enabled:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Finish the bar (its last state stays on screen)."""
        self._bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
