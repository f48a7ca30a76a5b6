"""End-of-run curves as one PNG: the algorithm's headline panels, then step timings.

Each algorithm names its panels in ``RUN_PANELS`` (GRPO: reward / validation accuracy and
loss; SFT: train / validation loss and grad norm; DPO: preference accuracy, loss, reward
margin); a panel draws train and validation series of the same metric on one axis.

matplotlib is imported inside :func:`plot_run`, and through ``matplotlib.figure.Figure``
rather than pyplot: a bare ``Figure`` renders with the Agg (PNG) canvas without selecting
a GUI backend, so it works on machines without a display and leaves the process's
pyplot state (and any interactive backend a notebook uses) untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.logging.progress import task_metric, tasks_in, timing_keys_in
from core.logging.sinks import to_float

FIGSIZE = (10.0, 7.0)  # inches
DPI = 120  # -> 1200 x 840 pixels

_TRAIN_COLOR, _VAL_COLOR = "tab:blue", "tab:red"
#: One colour per task of a mix (the first: the mix itself in the validation panel).
_TASK_COLORS = ("black", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def series(history: Sequence[Mapping[str, Any]], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows of ``split``; infinities become NaN gaps.

    NaN/inf must not reach the axes' autoscaling (an inf limit raises), and a gap in the
    line shows where the value was not finite.
    """
    steps, values = [], []
    for row in history:
        if row.get("split") != split or key not in row:
            continue
        number = to_float(row[key])
        if number is not None:
            steps.append(int(row["step"]))
            values.append(number if math.isfinite(number) else math.nan)
    return steps, values


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points, ignoring NaNs (NaN where a window has none)."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def _smoothing_window(n: int) -> int:
    """About a tenth of the run, at least 2 and at most 50 points."""
    return max(2, min(50, round(n / 10)))


def _no_data(ax: Any, what: str) -> None:
    """Mark a panel whose metrics the history lacks."""
    ax.text(0.5, 0.5, f"no data ({what})", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_yticks([])


# A panel: (title, ((split, metric key, legend label), ...)).
Panel = tuple[str, tuple[tuple[str, str, str], ...]]

RUN_PANELS: dict[str, tuple[Panel, ...]] = {
    "grpo": (
        (
            "reward / validation accuracy",
            (("train", "reward_mean", "train reward mean"), ("val", "accuracy", "val accuracy")),
        ),
        ("train loss", (("train", "loss", "loss"),)),
    ),
    "sft": (
        ("loss (token-mean NLL)", (("train", "loss", "train loss"), ("val", "loss", "val loss"))),
        ("gradient norm", (("train", "grad_norm", "grad norm"),)),
    ),
    "dpo": (
        (
            "preference accuracy (chosen reward > rejected)",
            (("train", "accuracy", "train"), ("val", "accuracy", "val")),
        ),
        ("loss", (("train", "loss", "train"), ("val", "loss", "val"))),
        ("reward margin (chosen - rejected)", (("train", "reward_margin", "train"), ("val", "reward_margin", "val"))),
    ),
}


def _plot_panel(ax: Any, history: Sequence[Mapping[str, Any]], panel: Panel) -> None:
    """Train series as points plus a moving average; validation series as markers."""
    title, curves = panel
    ax.set_title(title, fontsize=10, loc="left")
    drawn = False
    for split, key, label in curves:
        steps, values = series(history, split, key)
        if not steps:
            continue
        drawn = True
        if split == "val":
            ax.plot(steps, values, color=_VAL_COLOR, marker="o", lw=1.5, label=label)
            continue
        ax.plot(steps, values, color=_TRAIN_COLOR, alpha=0.35, marker=".", lw=1, label=label)
        window = _smoothing_window(len(values))
        if len(values) > window:
            ax.plot(
                steps,
                moving_average(values, window),
                color=_TRAIN_COLOR,
                lw=2,
                label=f"{label} ({window}-step moving avg)",
            )
    if not drawn:
        _no_data(ax, ", ".join(f"{split} {key}" for split, key, _ in curves))
        return
    ax.legend(loc="best", fontsize=8)


def task_panels(history: Sequence[Mapping[str, Any]]) -> tuple[Panel, ...]:
    """Per-task panels of a task mix (when its metrics are in the history): each task's held-out
    accuracy beside the mix's, and each task's train reward."""
    val = [row for row in history if row.get("split") == "val"]
    train = [row for row in history if row.get("split") == "train"]
    panels: list[Panel] = []
    val_tasks = tasks_in(val, "accuracy")
    if val_tasks:
        curves = [("val", "accuracy", "the mix")] + [("val", task_metric(t, "accuracy"), t) for t in val_tasks]
        panels.append(("validation accuracy by task", tuple(curves)))
    train_tasks = tasks_in(train, "reward_mean")
    if train_tasks:
        curves = [("train", task_metric(t, "reward_mean"), t) for t in train_tasks]
        panels.append(("train reward by task (moving average)", tuple(curves)))
    return tuple(panels)


def _plot_task_panel(ax: Any, history: Sequence[Mapping[str, Any]], panel: Panel) -> None:
    """One line per task (validation: markers; train: its moving average), colours by task."""
    title, curves = panel
    ax.set_title(title, fontsize=10, loc="left")
    for (split, key, label), color in zip(curves, _TASK_COLORS, strict=False):
        steps, values = series(history, split, key)
        if not steps:
            continue
        if split == "val":
            ax.plot(steps, values, color=color, marker="o", lw=1.5, label=label)
        else:
            ax.plot(steps, moving_average(values, _smoothing_window(len(values))), color=color, lw=1.5, label=label)
    ax.legend(loc="best", fontsize=8)


def _plot_timing_panel(ax: Any, history: Sequence[Mapping[str, Any]], keys: list[str]) -> None:
    """Per-phase seconds of each train step, stacked so the top edge is the step time."""
    train = [row for row in history if row.get("split") == "train"]
    steps = [int(row["step"]) for row in train]
    layers = []
    for key in keys:
        # A phase missing from a step (or not finite) took no measurable time there.
        values = [to_float(row.get(key)) for row in train]
        layers.append([v if v is not None and math.isfinite(v) else 0.0 for v in values])
    labels = [key.removeprefix("timing/").removesuffix("_s") for key in keys]
    ax.set_title("step time by phase", fontsize=10, loc="left")
    ax.stackplot(steps, layers, labels=labels, alpha=0.8)
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", fontsize=8, ncol=min(len(keys), 6))


def plot_run(
    history: Sequence[Mapping[str, Any]], out_path: Path | str, *, title: str = "", algorithm: str = "grpo"
) -> Path:
    """Write the run's curves to ``out_path`` (a .png) and return the path.

    Panels: ``RUN_PANELS[algorithm]``, then those of a task mix (:func:`task_panels`, only
    when the history has per-task metrics), then, only when the history has ``timing/*_s``
    keys, the step time by phase.  A panel whose metrics are missing says "no data".  Empty
    history -> ValueError.
    """
    if not history:
        raise ValueError("plot_run: empty history, nothing to plot")
    out_path = Path(out_path)
    if out_path.suffix.lower() != ".png":
        raise ValueError(f"plot_run: out_path must end in .png, got {out_path}")
    from matplotlib.figure import Figure  # lazy: matplotlib costs ~0.5 s to import

    if algorithm not in RUN_PANELS:
        raise ValueError(f"plot_run: unknown algorithm {algorithm!r}; known: {sorted(RUN_PANELS)}")
    panels, by_task = RUN_PANELS[algorithm], task_panels(history)
    timing_keys = timing_keys_in(row for row in history if row.get("split") == "train")
    rows = len(panels) + len(by_task) + bool(timing_keys)
    # The per-task panels add height (the others keep theirs).
    height = FIGSIZE[1] * rows / (rows - len(by_task))
    fig = Figure(figsize=(FIGSIZE[0], height), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=False):
        _plot_panel(ax, history, panel)
    for ax, panel in zip(axes[len(panels) :], by_task, strict=False):
        _plot_task_panel(ax, history, panel)
    if timing_keys:
        _plot_timing_panel(axes[-1], history, timing_keys)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=DPI)
    return out_path


#: (value, low, high) of an estimate with its confidence interval.
Interval = tuple[float, float, float]
_CURVE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")


def plot_pass_at_k(
    curves: Mapping[str, Sequence[tuple[int, float, float, float]]],
    out_path: Path | str,
    *,
    greedy: Interval | None = None,
    title: str = "",
) -> Path:
    """``dualrl eval``'s PNG: each curve (``{"pass@k": [(k, value, low, high), ...]}``) against
    k on a log2 axis with its interval as error bars, and the greedy accuracy (with its
    interval) as a horizontal band; returns the path."""
    out_path = Path(out_path)
    if out_path.suffix.lower() != ".png":
        raise ValueError(f"plot_pass_at_k: out_path must end in .png, got {out_path}")
    if not curves and greedy is None:
        raise ValueError("plot_pass_at_k: nothing to plot (no curve and no greedy accuracy)")
    from matplotlib.figure import Figure  # lazy: see the module docstring

    fig = Figure(figsize=(7.0, 4.5), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ks = sorted({k for points in curves.values() for k, *_ in points}) or [1]
    for (label, points), color in zip(curves.items(), _CURVE_COLORS, strict=False):
        x = [k for k, *_ in points]
        y = [v for _, v, _, _ in points]
        err = [[v - lo for _, v, lo, _ in points], [hi - v for _, v, _, hi in points]]
        ax.errorbar(x, y, yerr=err, color=color, marker="o", capsize=3, lw=1.5, label=label)
    if greedy is not None:
        value, low, high = greedy
        ax.axhline(value, color="gray", ls="--", lw=1, label=f"greedy accuracy {value:.3f}")
        ax.axhspan(low, high, color="gray", alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (samples per prompt)")
    ax.set_ylabel("score")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=DPI)
    return out_path
