"""``evaluate`` (core.algorithms.evaluation) on a scripted engine and the real arithmetic
environment, no workers: what it generates (batches, greedy flag, seeds), what it reports,
that GRPO's validation reports exactly that, and ``dualrl eval``'s table, JSON and PNG."""

from __future__ import annotations

import json

import pytest
import torch

from core.algorithms.estimators import maj_at_k, pass_at_k
from core.algorithms.eval_report import build_report, format_table, write_report
from core.algorithms.evaluation import VALIDATION_STREAM, EvalPlan, evaluate
from core.algorithms.grpo import grpo_validate
from core.algorithms.rollouts import sample_seeds
from core.data import BatchedDataDict
from core.datasets import PromptDatum
from core.environments import ArithmeticEnvironment, EnvironmentReturn
from core.models.char_tokenizer import char_tokenizer
from tests.grpo_runs import SMALL, grpo_run

TOKENIZER = char_tokenizer()
PROBLEMS = [(a, b) for a in range(3, 7) for b in range(2)]  # 8 prompts "a+b="


def _prompts() -> list[PromptDatum]:
    return [
        PromptDatum(f"{a}+{b}=", tuple(TOKENIZER(f"{a}+{b}=")["input_ids"]), {"ground_truth": str(a + b)})
        for a, b in PROBLEMS
    ]


def greedy_answer(answer: int) -> str:
    return str(answer) if answer % 2 == 0 else str(answer + 10)  # right on even answers only


def sampled_answer(answer: int, seed: int) -> str:
    return str(answer + seed % 3)  # right when the row's seed is 0 mod 3; else one of two wrong answers


class ScriptedEngine:
    """Answers every row of a batch by a rule of its prompt (and seed); records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, list[int] | None]] = []

    def generate(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        seeds = batch.get("sample_seeds")
        self.calls.append((batch.size, greedy, None if seeds is None else seeds.tolist()))
        rows = []
        for b in range(batch.size):
            prompt = batch["input_ids"][b, : int(batch["input_lengths"][b])].tolist()
            answer = eval(TOKENIZER.decode(prompt, skip_special_tokens=True).rstrip("="))
            text = greedy_answer(answer) if greedy else sampled_answer(answer, int(seeds[b]))
            rows.append((prompt, TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]))
        width = max(len(p) + len(g) for p, g in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (p, g) in enumerate(rows):
            ids[b, : len(p) + len(g)] = torch.tensor(p + g)
        return BatchedDataDict(
            output_ids=ids,
            generation_lengths=torch.tensor([len(g) for _, g in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(g) for p, g in rows]),
        )


def _answers(plan: EvalPlan) -> list[list[tuple[str, bool]]]:
    """(answer, correct) of every sampled row, per prompt, by the engine's rule."""
    n = plan.num_samples
    seeds = sample_seeds(plan.seed, 0, len(PROBLEMS) * n, stream=VALIDATION_STREAM).tolist()
    return [
        [(sampled_answer(a + b, s), s % 3 == 0) for s in seeds[i * n : (i + 1) * n]]
        for i, (a, b) in enumerate(PROBLEMS)
    ]


def test_the_greedy_pass_alone_is_the_validation_grpo_always_ran():
    engine, plan = ScriptedEngine(), EvalPlan(batch_size=3, seed=5)
    evaluation = evaluate(engine, ArithmeticEnvironment(), TOKENIZER, _prompts(), plan)
    assert [(size, greedy, seeds) for size, greedy, seeds in engine.calls] == [(3, True, None)] * 2 + [(2, True, None)]
    right = [(a + b) % 2 == 0 for a, b in PROBLEMS]
    lengths = [len(greedy_answer(a + b)) + 1 for a, b in PROBLEMS]  # the stop token counts
    assert evaluation.metrics() == {
        "reward_mean": sum(right) / 8,
        "response_length_mean": sum(lengths) / 8,
        "accuracy": sum(right) / 8,
        "num_samples": 8.0,
    }
    assert evaluation.greedy.completions[:2] == ["13", "4"]


def test_the_sampled_pass_draws_seeded_rows_and_estimates_every_k():
    engine, plan = ScriptedEngine(), EvalPlan(batch_size=3, seed=5, ks=(1, 2, 4), num_samples=6)
    metrics = evaluate(engine, ArithmeticEnvironment(), TOKENIZER, _prompts(), plan).metrics()
    sampled = [call for call in engine.calls if not call[1]]
    assert [size for size, _, _ in sampled] == [18, 18, 12]  # 3, 3, 2 prompts x 6 samples, prompt-major
    seeds = sample_seeds(5, 0, 48, stream=VALIDATION_STREAM).tolist()
    assert [s for _, _, chunk in sampled for s in chunk] == seeds
    answers = _answers(plan)
    for k in plan.ks:
        counts = [sum(ok for _, ok in rows) for rows in answers]
        assert metrics[f"pass@{k}"] == pytest.approx(sum(pass_at_k(6, c, k) for c in counts) / 8)
        assert metrics[f"mean@{k}"] == pytest.approx(sum(counts) / 48)
        majority = [maj_at_k([a for a, _ in rows], [ok for _, ok in rows], k) for rows in answers]
        assert metrics[f"maj@{k}"] == pytest.approx(sum(majority) / 8)
    assert metrics["pass@1"] == pytest.approx(metrics["mean@1"])
    assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"]
    assert 0 < metrics["pass@1"] < metrics["pass@4"] < 1  # the script is neither always right nor always wrong


def test_grpo_validation_reports_what_evaluate_measures(tmp_path):
    run = grpo_run(
        tmp_path,
        _prompts(),
        *SMALL,
        "grpo.val_batch_size=null",
        "grpo.seed=3",
        "grpo.val_pass_at_k=[1, 2]",
        "grpo.val_num_samples=3",
        "logger.num_val_samples_to_print=0",
        val_prompts=_prompts(),
    )
    synced = []
    try:
        assert run.tokenizer.get_vocab() == TOKENIZER.get_vocab()  # the prompts' tokenizer is the run's
        run.rollouts, run.env = ScriptedEngine(), ArithmeticEnvironment()
        metrics = grpo_validate(run, 7, lambda: synced.append(1) or {})
    finally:
        run.close()
    plan = EvalPlan(batch_size=8, seed=3, ks=(1, 2), num_samples=3)
    expected = evaluate(ScriptedEngine(), ArithmeticEnvironment(), TOKENIZER, _prompts(), plan).metrics()
    assert metrics == expected and synced == [1]  # the schedule's refit ran first
    assert {"accuracy", "pass@2", "maj@2", "mean@2", "sampled_response_length_mean"} <= set(expected)


class RewardOnlyEnv:
    """Rewards without saying which samples are correct."""

    name = "reward-only"

    def score(self, prompts, completions, metadata):
        return EnvironmentReturn([0.5] * len(prompts), [{} for _ in prompts])


def test_pass_at_k_needs_an_environment_that_says_which_samples_are_correct():
    greedy_only = evaluate(ScriptedEngine(), RewardOnlyEnv(), TOKENIZER, _prompts(), EvalPlan(8, 0)).metrics()
    assert "accuracy" not in greedy_only and greedy_only["reward_mean"] == 0.5
    with pytest.raises(ValueError, match=r"grpo.val_pass_at_k: .*info\['correct'\]"):
        evaluate(ScriptedEngine(), RewardOnlyEnv(), TOKENIZER, _prompts(), EvalPlan(8, 0, (1,), 1)).per_prompt()


def test_the_report_table_json_and_plot(tmp_path):
    plan = EvalPlan(batch_size=8, seed=1, ks=(1, 2, 4), num_samples=4)
    evaluation = evaluate(ScriptedEngine(), ArithmeticEnvironment(), TOKENIZER, _prompts(), plan)
    report = build_report(evaluation, {"model": "scripted", "dataset": "8 sums"})
    table = format_table(report)
    assert "greedy pass (1 sample per prompt, 8 prompts)" in table and "sampled pass (4 samples per prompt)" in table
    assert "pass@k" in table and "maj@k" in table and "mean@k" in table
    assert "95% intervals: percentile bootstrap over the 8 prompts (1000 resamples, seed 0)" in table
    json_path, png = write_report(report, tmp_path / "out", title="scripted")
    saved = json.loads(json_path.read_text())
    assert saved["model"] == "scripted" and saved["ks"] == [1, 2, 4] and saved["num_samples"] == 4
    for name, value in evaluation.metrics().items():
        if name != "num_samples":
            e = saved["metrics"][name]
            assert e["value"] == pytest.approx(value) and e["low"] <= e["value"] <= e["high"], name
    assert saved["prompts"][0] == {
        "prompt": "3+0=",
        "ground_truth": "3",
        "greedy_completion": "13",
        "greedy_reward": 0.0,
        "sampled_correct": sum(ok for _, ok in _answers(plan)[0]),
    }
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Greedy only: the plot shows the greedy accuracy alone.
    greedy = build_report(
        evaluate(ScriptedEngine(), ArithmeticEnvironment(), TOKENIZER, _prompts(), EvalPlan(8, 0)), {}
    )
    assert "sampled pass" not in format_table(greedy)
    assert write_report(greedy, tmp_path / "greedy", title="")[1].is_file()
