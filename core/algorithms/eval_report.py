"""What ``dualrl eval`` reports: every metric with its confidence interval, as a printed
table, a JSON file and a PNG of pass@k / maj@k / mean@k against k.

Intervals: percentile bootstrap over prompts (``core.algorithms.estimators.Bootstrap``:
1000 resamples of the prompts with a fixed seed, 95 %), one set of resamples for every
metric (a task mix's per-task metrics, ``tasks/<task>/<metric>``: one set per task, over its
own prompts).  A prompt is the unit resampled because its samples are not independent of each
other: n samples of one prompt say more about that prompt than about the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.algorithms.estimators import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, Bootstrap
from core.algorithms.evaluation import Evaluation
from core.logging import plot_pass_at_k
from core.logging.progress import task_metric, task_metric_parts

JSON_FILENAME, PLOT_FILENAME = "eval.json", "pass_at_k.png"
#: The sampled pass's families of metrics, one column of the table / one curve each.
FAMILIES = ("pass", "maj", "mean")


@dataclass(frozen=True)
class Estimate:
    """A metric's mean over prompts and its bootstrap interval."""

    value: float
    low: float
    high: float


@dataclass
class EvalReport:
    """One evaluation's estimates and what they were measured on."""

    details: dict[str, Any]  # model, checkpoint, dataset, generation: what the title and the JSON say
    num_prompts: int
    ks: tuple[int, ...]
    num_samples: int  # of the sampled pass (0: none)
    estimates: dict[str, Estimate]
    prompts: list[dict[str, Any]] = field(default_factory=list)  # per-prompt outcomes (JSON only)


def build_report(evaluation: Evaluation, details: Mapping[str, Any]) -> EvalReport:
    """Every metric of ``evaluation`` with its interval, and each prompt's outcome."""
    estimates = _estimates(evaluation.per_prompt())
    for task, per_prompt in evaluation.per_task().items():
        estimates.update({task_metric(task, name): e for name, e in _estimates(per_prompt).items()})
    sampled = evaluation.sampled
    return EvalReport(
        dict(details),
        len(evaluation.prompts),
        evaluation.ks,
        sampled.num_samples if sampled is not None else 0,
        estimates,
        _prompt_outcomes(evaluation),
    )


def _estimates(per_prompt: Mapping[str, list[float]]) -> dict[str, Estimate]:
    """Each metric's mean with its bootstrap interval (one set of resamples for all)."""
    boot = Bootstrap(len(next(iter(per_prompt.values()))))
    out = {}
    for name, values in per_prompt.items():
        low, high = boot.interval(values)
        out[name] = Estimate(sum(values) / len(values), low, high)
    return out


def _prompt_outcomes(evaluation: Evaluation) -> list[dict[str, Any]]:
    greedy, sampled = evaluation.greedy, evaluation.sampled
    correct = sampled.info_values("correct") if sampled is not None else None
    counts = [sum(map(bool, c)) for c in sampled.by_prompt(correct)] if sampled is not None and correct else None
    rows = []
    for i, prompt in enumerate(evaluation.prompts):
        row = {
            "prompt": prompt.prompt,
            "ground_truth": prompt.metadata.get("ground_truth"),
            "greedy_completion": greedy.completions[i],
            "greedy_reward": greedy.rewards[i],
        }
        if counts is not None:
            row["sampled_correct"] = counts[i]
        if "task" in greedy.infos[i]:
            row["task"] = greedy.infos[i]["task"]
        rows.append(row)
    return rows


def _cell(e: Estimate, digits: int = 3) -> str:
    return f"{e.value:.{digits}f} [{e.low:.{digits}f}, {e.high:.{digits}f}]"


def format_table(report: EvalReport) -> str:
    """The printed report: the greedy pass, then the sampled pass's k rows."""
    e, width = report.estimates, 24
    lines = [f"greedy pass (1 sample per prompt, {report.num_prompts} prompts)"]
    for name in ("accuracy", "reward_mean", "response_length_mean"):
        if name in e:
            lines.append(f"  {name:<22}{_cell(e[name], 2 if 'length' in name else 3)}")
    if report.ks:
        lines.append(f"sampled pass ({report.num_samples} samples per prompt)")
        columns = [f for f in FAMILIES if f"{f}@{report.ks[0]}" in e]
        lines.append(("  " + f"{'k':<4}" + "".join(f"{f + '@k':<{width}}" for f in columns)).rstrip())
        for k in report.ks:
            lines.append(("  " + f"{k:<4}" + "".join(f"{_cell(e[f'{f}@{k}']):<{width}}" for f in columns)).rstrip())
        lines.append(f"  {'response_length_mean':<22}{_cell(e['sampled_response_length_mean'], 2)}")
    lines += _task_table(report)
    lines.append(
        f"{CONFIDENCE:.0%} intervals: percentile bootstrap over the {report.num_prompts} prompts "
        f"({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED})"
    )
    return "\n".join(lines)


def _task_table(report: EvalReport) -> list[str]:
    """Per task of a mix: its prompts, greedy accuracy and pass@k for every k (with intervals)."""
    e = report.estimates
    tasks = list(dict.fromkeys(p[0] for key in e if (p := task_metric_parts(key)) is not None))
    if not tasks:
        return []
    columns = ["accuracy"] + [f"pass@{k}" for k in report.ks]
    columns = [c for c in columns if task_metric(tasks[0], c) in e]
    width = max(len(t) for t in tasks) + 2
    lines = [f"by task (greedy accuracy{', sampled pass@k' if report.ks else ''})"]
    lines.append(("  " + f"{'task':<{width}}{'prompts':<9}" + "".join(f"{c:<24}" for c in columns)).rstrip())
    for task in tasks:
        prompts = sum(1 for row in report.prompts if row.get("task") == task)
        cells = "".join(f"{_cell(e[task_metric(task, c)]):<24}" for c in columns)
        lines.append(("  " + f"{task:<{width}}{prompts:<9}" + cells).rstrip())
    return lines


def write_report(report: EvalReport, out_dir: Path, title: str) -> tuple[Path, Path]:
    """``eval.json`` and ``pass_at_k.png`` under ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        **report.details,
        "num_prompts": report.num_prompts,
        "num_samples": report.num_samples,
        "ks": list(report.ks),
        "interval": {
            "method": "percentile bootstrap over prompts",
            "confidence": CONFIDENCE,
            "resamples": BOOTSTRAP_RESAMPLES,
            "seed": BOOTSTRAP_SEED,
        },
        "metrics": {name: asdict(e) for name, e in report.estimates.items()},
        "prompts": report.prompts,
    }
    json_path = out_dir / JSON_FILENAME
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    curves = {
        f"{family}@k": [(k, *_triple(report.estimates[f"{family}@{k}"])) for k in report.ks]
        for family in FAMILIES
        if report.ks and f"{family}@{report.ks[0]}" in report.estimates
    }
    greedy = report.estimates.get("accuracy")
    plot = plot_pass_at_k(
        curves, out_dir / PLOT_FILENAME, greedy=_triple(greedy) if greedy is not None else None, title=title
    )
    return json_path, plot


def _triple(e: Estimate) -> tuple[float, float, float]:
    return e.value, e.low, e.high
