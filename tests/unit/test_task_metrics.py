"""Per-task metrics of a task mix (``tasks/<task>/<metric>``) without workers: a rollout batch's,
an evaluation's (GRPO validation and ``dualrl eval``: each task's pass@k with its own interval),
and what the progress bar, the end-of-run summary and curves.png make of them."""

from __future__ import annotations

import json

import pytest
import torch

from core.algorithms.eval_report import build_report, format_table, write_report
from core.algorithms.evaluation import EvalPlan, evaluate
from core.algorithms.task_metrics import train_task_metrics
from core.data import BatchedDataDict
from core.datasets import PromptDatum
from core.environments import EnvironmentReturn
from core.logging import format_summary, plot_run
from core.logging.progress import StepProgress, pick_progress_values, task_metric_parts
from core.models.byte_tokenizer import byte_tokenizer

TOKENIZER = byte_tokenizer()
#: prompt -> (task, answer): two tasks, three prompts each.
PROBLEMS = {
    "reverse ab": ("spell_backward", "ba"),
    "reverse cd": ("spell_backward", "dc"),
    "reverse ef": ("spell_backward", "fe"),
    "count a in aa": ("letter_counting", "2"),
    "count b in b": ("letter_counting", "1"),
    "count c in cc": ("letter_counting", "2"),
}


class TaskEnv:
    """Scores exact answers and names each sample's task (as the reasoning_gym environment does)."""

    name = "tasks"

    def score(self, prompts, completions, metadata):
        rewards = [float(c == m["ground_truth"]) for c, m in zip(completions, metadata, strict=True)]
        infos = [
            {"correct": r == 1.0, "answer": c, "task": m["task"]}
            for r, c, m in zip(rewards, completions, metadata, strict=True)
        ]
        return EnvironmentReturn(rewards, infos)


class ScriptedEngine:
    """Greedy: right on the spelling prompts but the last; sampled: right on every second row."""

    def generate(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        rows = []
        for b in range(batch.size):
            prompt = batch["input_ids"][b, : int(batch["input_lengths"][b])].tolist()
            text = TOKENIZER.decode(prompt, skip_special_tokens=True)
            task, answer = PROBLEMS[text]
            right = (task == "spell_backward" and text != "reverse ef") if greedy else b % 2 == 0
            out = answer if right else "x"
            rows.append((prompt, TOKENIZER(out, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]))
        width = max(len(p) + len(g) for p, g in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (p, g) in enumerate(rows):
            ids[b, : len(p) + len(g)] = torch.tensor(p + g)
        return BatchedDataDict(
            output_ids=ids,
            generation_lengths=torch.tensor([len(g) for _, g in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(g) for p, g in rows]),
        )


def _prompts() -> list[PromptDatum]:
    return [
        PromptDatum(text, tuple(TOKENIZER(text)["input_ids"]), {"ground_truth": answer, "task": task})
        for text, (task, answer) in PROBLEMS.items()
    ]


def test_a_rollout_batch_reports_each_tasks_reward_accuracy_and_share():
    infos = [{"correct": True, "task": "a"}, {"correct": False, "task": "b"}, {"correct": False, "task": "a"}]
    metrics = train_task_metrics(infos, [1.0, 0.5, 0.25])
    assert metrics == {
        "tasks/a/reward_mean": 0.625,
        "tasks/a/accuracy": 0.5,
        "tasks/a/share": 2 / 3,
        "tasks/b/reward_mean": 0.5,
        "tasks/b/accuracy": 0.0,
        "tasks/b/share": 1 / 3,
    }
    assert train_task_metrics([{"correct": True}], [1.0]) == {}  # an environment that names no task


def test_validation_and_eval_report_every_metric_per_task(tmp_path):
    plan = EvalPlan(batch_size=4, seed=0, ks=(1, 2), num_samples=2)
    evaluation = evaluate(ScriptedEngine(), TaskEnv(), TOKENIZER, _prompts(), plan)
    metrics = evaluation.metrics()
    assert metrics["accuracy"] == pytest.approx(2 / 6)
    assert metrics["tasks/spell_backward/accuracy"] == pytest.approx(2 / 3)
    assert metrics["tasks/letter_counting/accuracy"] == 0.0
    assert metrics["tasks/spell_backward/num_samples"] == 3.0
    # every sampled prompt has one right and one wrong sample: pass@1 0.5, pass@2 1 in each task
    for task in ("spell_backward", "letter_counting"):
        assert metrics[f"tasks/{task}/pass@1"] == 0.5 and metrics[f"tasks/{task}/pass@2"] == 1.0
    report = build_report(evaluation, {"model": "scripted"})
    table = format_table(report)
    assert "by task (greedy accuracy, sampled pass@k)" in table
    line = next(row for row in table.splitlines() if row.strip().startswith("spell_backward"))
    assert line.split()[1] == "3" and "0.667" in line  # prompts, greedy accuracy
    json_path, _ = write_report(report, tmp_path, title="scripted")
    saved = json.loads(json_path.read_text())
    task_accuracy = saved["metrics"]["tasks/spell_backward/accuracy"]
    assert task_accuracy["value"] == pytest.approx(2 / 3) and task_accuracy["low"] <= task_accuracy["high"]
    assert [p["task"] for p in saved["prompts"]][:4] == ["spell_backward"] * 3 + ["letter_counting"]


def _history():
    rows = []
    for step in range(1, 11):
        rows.append(
            {"split": "train", "step": step, "reward_mean": 0.1 * step, "loss": 1.0, "timing/train_s": 1.0}
            | {"tasks/a/reward_mean": 0.05 * step, "tasks/b/reward_mean": 0.1}
        )
    for step, acc in ((0, 0.2), (10, 0.5)):
        rows.append({"split": "val", "step": step, "accuracy": acc, "tasks/a/accuracy": acc, "tasks/b/accuracy": 0.3})
    return rows


def test_the_bar_summary_and_curves_show_each_task(tmp_path):
    assert task_metric_parts("val/tasks/spell_backward/pass@8") == ("spell_backward", "pass@8")
    assert task_metric_parts("val/accuracy") is None
    picked = pick_progress_values({"val/accuracy": 0.4, "val/tasks/a/accuracy": 0.5, "val/tasks/a/reward_mean": 0.9})
    assert picked == {"val_accuracy": 0.4, "a": 0.5}
    bar = StepProgress(3, enabled=False)
    bar.update(1, {"reward_mean": 0.25, "val/tasks/a/accuracy": 0.5})
    assert bar.values == {"reward": 0.25, "a": 0.5}
    summary = format_summary(_history(), wall_time_s=12.0, run_dir=tmp_path)
    assert "  a: val accuracy: first 0.200 (step 0) -> last 0.500 (step 10)" in summary
    assert "  b: train reward mean: first 10% 0.100 -> last 10% 0.100" in summary
    png = plot_run(_history(), tmp_path / "curves.png")
    plain = plot_run([{k: v for k, v in r.items() if "tasks/" not in k} for r in _history()], tmp_path / "plain.png")
    from PIL import Image

    # two panels more (validation accuracy and train reward by task), the others as tall as before
    assert Image.open(png).size[1] > Image.open(plain).size[1] == 840
