"""reasoning-gym tasks without workers: the problems and their splits, the reward, the refusals
(by name, before any worker starts), the byte tokenizer, the built-in model's warm start and
cache key.  reasoning-gym is a dev extra (the Makefile installs it); the one test of a machine
without it hides the package instead of skipping."""

from __future__ import annotations

import argparse
import collections
import sys

import pytest

from core.algorithms.config import GRPORunConfig, SFTRunConfig
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config
from core.datasets import build_prompt_datasets
from core.datasets.config import DataConfig
from core.environments import RewardError, make_environment
from core.environments.reasoning_gym import SEED_REGION, ReasoningGymTask, _zigzag
from core.environments.reasoning_gym_checks import INSTALL_COMMAND
from core.models.builtin import BUILTIN_MODELS, REASONING_GYM_LLAMA, builtin_tokenizer
from core.models.byte_tokenizer import BYTE_OFFSET, byte_tokenizer
from dualrl.cli import load_command_config

RECIPE = EMBEDDED_CONFIGS["grpo"].with_name("grpo_reasoning_gym.yaml")
SFT_RECIPE = EMBEDDED_CONFIGS["grpo"].with_name("sft_reasoning_gym.yaml")
MIX = {
    "tasks": [
        {"name": "spell_backward", "settings": {"min_word_len": 3, "max_word_len": 5}},
        {"name": "letter_counting", "weight": 2.0, "seed": 7, "settings": {"min_words": 1, "max_words": 2}},
    ]
}


def _config_errors(*overrides: str, path=RECIPE) -> list[str]:
    """What ``dualrl config --config PATH OVERRIDES`` refuses (no worker, no Ray)."""
    args = argparse.Namespace(command="config", config=str(path), overrides=list(overrides), backend=None)
    with pytest.raises(ConfigError) as info:
        load_command_config(args)
    return info.value.errors


def _the_error(field: str, *overrides: str, path=RECIPE) -> str:
    lines = [e for e in _config_errors(*overrides, path=path) if e.startswith(f"{field}: ")]
    assert len(lines) == 1, _config_errors(*overrides, path=path)
    return lines[0]


# ----------------------------------------------------------------------------- the tokenizer
def test_the_byte_tokenizer_round_trips_any_text_and_loads_like_a_hub_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    text = 'How many times does the letter "é" appear in: "née ×"?\n'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[1:] == [b + BYTE_OFFSET for b in text.encode()]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, 2, 259)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids and loaded.get_vocab() == tok.get_vocab()


def test_the_builtin_english_model_reads_bytes_and_its_vocabulary_holds_them():
    assert builtin_tokenizer("builtin:reasoning-gym-llama").get_vocab() == byte_tokenizer().get_vocab()
    assert len(byte_tokenizer()) <= REASONING_GYM_LLAMA["vocab_size"] and REASONING_GYM_LLAMA["vocab_size"] % 8 == 0
    assert BUILTIN_MODELS["reasoning-gym-llama"] == (REASONING_GYM_LLAMA, True)
    assert BUILTIN_MODELS["reasoning-gym-llama-base"] == (REASONING_GYM_LLAMA, False)


# ----------------------------------------------------------------------------- problems and splits
def test_problems_are_a_pure_function_of_seed_and_index_drawn_by_weight():
    task = ReasoningGymTask(MIX)
    rows = task.problems(42, 0, 600)
    assert rows == ReasoningGymTask(MIX).problems(42, 0, 600)
    counts = collections.Counter(r["task"] for r in rows)
    assert 0.25 < counts["spell_backward"] / 600 < 0.42  # weight 1 of 3
    row = next(r for r in rows if r["task"] == "letter_counting")
    assert row["task_seed"] == 7 and row["task_settings"] == {"min_words": 1, "max_words": 2}
    assert row["prompt"].startswith("How many times does the letter") and row["answer"].isdigit()
    assert row["task_metadata"]["source_dataset"] == "letter_counting"
    with pytest.raises(ValueError, match=r"data.reasoning_gym: problem index must be an int in \[0, 2\*\*48\)"):
        task.problem(42, -1)


def test_seeds_own_disjoint_problems_where_reasoning_gyms_own_seeds_overlap():
    import reasoning_gym

    # reasoning-gym draws item i of a generator seeded s from Random(s + i): seeds 5 and 6 are
    # the same problems shifted by one, so "another seed" alone would not hold problems out.
    five = reasoning_gym.create_dataset("spell_backward", seed=5)
    six = reasoning_gym.create_dataset("spell_backward", seed=6)
    assert [five[i + 1]["question"] for i in range(20)] == [six[i]["question"] for i in range(20)]
    # Here seed s owns the generator indices [zigzag(s) * 2**48, (zigzag(s) + 1) * 2**48).
    regions = [_zigzag(s) for s in range(-50, 51)]
    assert sorted(regions) == list(range(101))
    task = ReasoningGymTask({"tasks": [{"name": "spell_backward"}]})
    assert task.problem(43, 0)["task_metadata"]["source_index"] == _zigzag(43) * SEED_REGION
    assert task.problem(42, 1)["prompt"] != task.problem(43, 0)["prompt"]


def _splits(val_seed: int, seed: int = 42, num_val: int = 60):
    data = DataConfig(
        dataset_name="reasoning_gym",
        reasoning_gym=MIX,
        prompt_template="{prompt}\n",
        max_input_seq_length=96,
        answer_key="answer",
        val_seed=val_seed,
    )
    return build_prompt_datasets(data, None, byte_tokenizer(), num_val=num_val, seed=seed)


@pytest.mark.parametrize("val_seed", [43, 42])
def test_train_and_held_out_questions_never_overlap(val_seed):
    train, val = _splits(val_seed)
    held_out = {val[i].metadata["raw_prompt"] for i in range(len(val))}
    assert len(held_out) == 60  # distinct
    seen = [train[i].metadata["raw_prompt"] for i in range(400)]
    assert not held_out & set(seen)  # also when the two seeds are equal: the question check
    datum = val[0]
    assert datum.prompt == datum.metadata["raw_prompt"] + "\n" and datum.metadata["ground_truth"]
    assert {"task", "task_seed", "task_settings", "task_metadata"} <= set(datum.metadata)


@pytest.mark.parametrize("max_n", [3, 255])
def test_a_task_the_held_out_questions_exhaust_is_refused_by_name(max_n):
    """count_bits up to 3 has 3 questions: the held-out draws take all of them, and the train
    stream (which skips held-out questions) would drop the task without a word."""
    mix = {"tasks": [*MIX["tasks"], {"name": "count_bits", "settings": {"max_n": max_n}}]}
    data = DataConfig(
        dataset_name="reasoning_gym", reasoning_gym=mix, prompt_template="{prompt}\n", max_input_seq_length=96
    )
    if max_n == 3:
        with pytest.raises(
            ValueError, match=r"data\.reasoning_gym\.tasks\[\d\] \(count_bits\): \d+ of the \d+ training "
        ):
            build_prompt_datasets(data, None, byte_tokenizer(), num_val=60, seed=42)
    else:
        train, _ = build_prompt_datasets(data, None, byte_tokenizer(), num_val=60, seed=42)
        assert "count_bits" in {train[i].metadata["task"] for i in range(60)}


# ----------------------------------------------------------------------------- the reward
def test_the_reward_is_the_tasks_own_score_answer_with_partial_credit():
    import reasoning_gym

    env = make_environment({"name": "reasoning_gym"})
    _, val = _splits(43)
    spell = next(val[i] for i in range(len(val)) if val[i].metadata["task"] == "spell_backward")
    count = next(val[i] for i in range(len(val)) if val[i].metadata["task"] == "letter_counting")
    answer = spell.metadata["ground_truth"]
    wrong_last = answer[:-1] + ("a" if answer[-1] != "a" else "b")
    completions = [f" {answer}\n", wrong_last, count.metadata["ground_truth"], "x"]
    rows = [spell, spell, count, count]
    out = env.score([r.prompt for r in rows], completions, [r.metadata for r in rows])
    reference = reasoning_gym.create_dataset("spell_backward", seed=0, min_word_len=3, max_word_len=5)
    entry = {"question": spell.metadata["raw_prompt"], "answer": answer, "metadata": spell.metadata["task_metadata"]}
    assert out.rewards[1] == reference.score_answer(wrong_last, entry) == pytest.approx((len(answer) - 1) / len(answer))
    assert out.rewards[0] == 1.0 and out.rewards[2] == 1.0 and out.rewards[3] == 0.0
    assert [i["correct"] for i in out.infos] == [True, False, True, False]
    assert [i["task"] for i in out.infos] == ["spell_backward", "spell_backward", "letter_counting", "letter_counting"]
    assert out.infos[0]["answer"] == answer  # stripped: what maj@k votes on
    with pytest.raises(RewardError, match=r"sample 0 .*metadata lacks \['task'"):
        env.score(["2+2="], ["4"], [{"ground_truth": "4"}])


# ----------------------------------------------------------------------------- refusals
def test_the_recipe_is_three_tasks_one_not_arithmetic_scored_by_reasoning_gym():
    import reasoning_gym.factory

    cfg = load_config(RECIPE, schema=GRPORunConfig)
    tasks = cfg.data.reasoning_gym.tasks
    modules = [reasoning_gym.factory.DATASETS[t.name][0].__module__ for t in tasks]
    assert len(tasks) >= 3 and any(".arithmetic." not in m for m in modules), modules
    assert cfg.env.name == "reasoning_gym" and cfg.policy.model_name == "builtin:reasoning-gym-llama"
    sft = load_config(SFT_RECIPE, schema=SFTRunConfig)
    assert sft.data.reasoning_gym == cfg.data.reasoning_gym and sft.data.prompt_template == cfg.data.prompt_template


def test_a_task_that_does_not_exist_is_refused_by_name_with_the_closest_names():
    line = _the_error("data.reasoning_gym.tasks[0].name", "data.reasoning_gym.tasks=[{name: spell_backwards}]")
    assert "'spell_backwards' is not a reasoning-gym task; did you mean 'spell_backward'?" in line


@pytest.mark.parametrize(
    "task, field, message",
    [
        ("{name: spell_backward, settings: {min_word_len: 0}}", "settings", "AssertionError: min_word_len must be"),
        ("{name: spell_backward, settings: {word_len: 3}}", "settings.word_len", "not a setting of spell_backward"),
        ("{name: spell_backward, settings: {seed: 3}}", "settings.seed", "set by the entry's own `seed` key"),
        ("{name: spell_backward, settings: {size: 3}}", "settings.size", "the problem stream is infinite"),
        ("{name: spell_backward, weight: 0}", "weight", "must be > 0.0, got 0"),
        ("{name: spell_backward, weight: -1.5}", "weight", "must be > 0.0, got -1.5"),
        ("{name: spell_backward, weight: .inf}", "weight", "must be a finite number > 0"),
    ],
)
def test_a_bad_setting_or_weight_is_refused_by_name(task, field, message):
    line = _the_error(f"data.reasoning_gym.tasks[0].{field}", f"data.reasoning_gym.tasks=[{task}]")
    assert message in line


def test_the_mix_and_its_source_go_together():
    twice = "data.reasoning_gym.tasks=[{name: gcd}, {name: gcd}]"
    assert "'gcd' is listed twice" in _the_error("data.reasoning_gym.tasks[1].name", twice)
    assert "required with the built-in source" in _the_error("data.reasoning_gym", "data.reasoning_gym=null")
    on_arithmetic = _the_error("data.reasoning_gym", "data.dataset_name=arithmetic", path=SFT_RECIPE)
    assert "only the built-in source 'reasoning_gym' reads it" in on_arithmetic
    arithmetic_knobs = _the_error("env.arithmetic", "env.arithmetic={max_value: 9}")
    assert "not read by env.name 'reasoning_gym'" in arithmetic_knobs
    model = _the_error(
        "policy.model_name",
        "data.dataset_name=arithmetic",
        "data.reasoning_gym=null",
        "env.name=arithmetic",
        "data.max_input_seq_length=16",
    )
    assert "builtin:reasoning-gym-llama is warm-started on the run's reasoning-gym tasks" in model


def test_without_the_package_the_config_is_refused_before_any_worker_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` sees without it
    errors = _config_errors()
    for field in ("data.dataset_name", "env.name"):
        line = next(e for e in errors if e.startswith(f"{field}: "))
        assert "needs the optional package reasoning-gym" in line and INSTALL_COMMAND in line
