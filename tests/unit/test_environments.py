"""Environments without Ray: the arithmetic task, the math answer checker, the reward
checks and the registry.  Fast (pure Python), so they run in every ``make test``."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from core.environments import (
    BUILTIN_ENVIRONMENTS,
    ArithmeticEnvironment,
    ArithmeticTask,
    EnvironmentReturn,
    MathEnvironment,
    RewardError,
    answers_match,
    check_environment_return,
    extract_answer,
    ground_truth_answer,
    make_environment,
    normalize_number,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ConstantEnv:
    """A user environment (built by import path in the registry tests): constant reward."""

    name = "constant"

    def __init__(self, cfg):
        # A user class gets the whole typed `env` section and reads its own settings from kwargs.
        self.value = float(cfg.kwargs.get("value", 0.5))

    def score(self, prompts, completions, metadata):
        return EnvironmentReturn([self.value] * len(prompts), [{} for _ in prompts])


class NotAnEnvironment:
    def __init__(self, cfg):
        pass


# ---------------------------------------------------------------------- arithmetic
CONFIGS = [
    None,
    {"num_operands": 4, "operations": ["+", "-", "*"], "max_value": 12},
    {"num_operands": 3, "operations": ["-", "*"], "min_value": 2, "max_value": 9},
    {"num_operands": 5, "operations": ["-"], "min_value": 1, "max_value": 30},
    {"num_operands": 3, "operations": ["+", "-", "*"], "min_value": -9, "max_value": 9, "allow_negative": True},
]


def _prefix_totals(prompt: str) -> list[int]:
    """Python's value of the expression cut before every top-level + or - (independent of
    the task's own term logic), then of the whole expression."""
    body = prompt[:-1]
    cuts = [m.start() for m in re.finditer(r"(?<=[\d)])[+-]", body)]
    return [eval(body[:cut]) for cut in cuts] + [eval(body)]


def test_problem_is_a_pure_function_of_settings_seed_and_index():
    first, second = ArithmeticTask({"num_operands": 3}), ArithmeticTask({"num_operands": 3})
    assert first.problems(7, 0, 50) == second.problems(7, 0, 50)
    assert first.problem(7, 31) == first.problems(7, 30, 2)[1]
    assert first.problems(7, 0, 50) != first.problems(8, 0, 50)


def test_problems_are_the_same_in_other_processes():
    """Salted hash() must play no part: other hash seeds give the same problems."""
    script = (
        "import json; from core.environments import ArithmeticTask; "
        "print(json.dumps(ArithmeticTask({'num_operands': 3}).problems(11, 100, 20)))"
    )
    expected = ArithmeticTask({"num_operands": 3}).problems(11, 100, 20)
    for hash_seed in ("1", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == expected


@pytest.mark.parametrize("cfg", CONFIGS)
def test_answers_equal_python_eval_and_prompts_have_the_format(cfg):
    task = ArithmeticTask(cfg)
    for item in task.problems(3, 0, 200):
        prompt = item["prompt"]
        assert re.fullmatch(r"(\(-\d+\)|\d+)([-+*](\(-\d+\)|\d+))+=", prompt), prompt
        assert prompt.count("+") + prompt.count("*") + prompt.count("-") >= task.num_operands - 1
        assert item["answer"] == str(eval(prompt[:-1]))


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if not (c or {}).get("allow_negative")])
def test_without_allow_negative_no_running_total_is_negative(cfg):
    task = ArithmeticTask(cfg)
    for item in task.problems(5, 0, 300):
        operands = [int(v) for v in re.findall(r"\d+", item["prompt"])]
        assert all(task.min_value <= v <= task.max_value for v in operands), item
        assert min(_prefix_totals(item["prompt"])) >= 0, item


def test_allow_negative_does_produce_negative_answers():
    task = ArithmeticTask({"allow_negative": True, "min_value": -5, "max_value": 5})
    assert any(int(p["answer"]) < 0 for p in task.problems(0, 0, 100))


@pytest.mark.parametrize(
    "cfg",
    [
        None,
        {"num_operands": 3, "operations": ["+", "-", "*"], "min_value": 0, "max_value": 4},
        {"num_operands": 3, "operations": ["-", "*"], "min_value": 1, "max_value": 5},
        {"num_operands": 3, "operations": ["+", "*"], "max_value": 3, "allow_negative": True, "min_value": -3},
        # a total closed in the middle (a - b*c + d, a - b - c*d, ...): the convolution path
        {"num_operands": 4, "operations": ["+", "-", "*"], "min_value": 0, "max_value": 3},
    ],
)
def test_num_distinct_problems_matches_brute_force(cfg):
    task = ArithmeticTask(cfg)
    values = range(task.min_value, task.max_value + 1)
    valid = set()
    for ops in itertools.product(task.operations, repeat=task.num_operands - 1):
        for operands in itertools.product(values, repeat=task.num_operands):
            prompt = task.format_prompt(list(operands), list(ops))
            if task.allow_negative or min(_prefix_totals(prompt)) >= 0:
                valid.add(prompt)
    assert task.num_distinct_problems() == len(valid)
    drawn = {p["prompt"] for p in task.problems(0, 0, 2 * len(valid))}
    assert drawn <= valid and len(drawn) > len(valid) // 4


def test_num_distinct_problems_of_the_tool_arithmetic_config_is_counted_quickly():
    # core/configs/grpo_tool_arithmetic.yaml: three operands up to 999 with "*" (a state
    # programme over (total, open term) had not finished after 8 minutes).  Per operator sequence: 4 x 1e9
    # without "-"; a+b-c: sum min(a+b, 999)+1; a-b+c: 500500 x 1000; a-b-c: sum (a+1)(a+2)/2;
    # a*b-c: sum min(ab, 999)+1; a-b*c: sum #(b, c: bc <= a) -- 6501009552 in all.
    task = ArithmeticTask({"num_operands": 3, "operations": ["+", "-", "*"], "min_value": 0, "max_value": 999})
    start = time.perf_counter()
    assert task.num_distinct_problems() == 6_501_009_552
    assert time.perf_counter() - start < 60  # 0.4 s on a quiet 2-core CPU; the old programme: > 8 min


def test_format_prompt():
    assert ArithmeticTask.format_prompt([12, 7], ["+"]) == "12+7="
    assert ArithmeticTask.format_prompt([3, 4, 2], ["*", "-"]) == "3*4-2="
    assert ArithmeticTask.format_prompt([3, -4], ["-"]) == "3-(-4)="
    with pytest.raises(ValueError, match="3 operands need 2 operators, got 1"):
        ArithmeticTask.format_prompt([1, 2, 3], ["+"])
    with pytest.raises(ValueError, match="unknown operation '/'"):
        ArithmeticTask.format_prompt([1, 2], ["/"])


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"max_vale": 3}, r"env\.arithmetic\.max_vale: unknown key"),
        (
            {"min_value": 9, "max_value": 3},
            r"env\.arithmetic\.min_value: 9 is greater than max_value \(3\)",
        ),
        ({"num_operands": 1}, r"env\.arithmetic\.num_operands: must be >= 2, got 1"),
        ({"operations": ["+", "/"]}, r"env\.arithmetic\.operations\[1\]: expected one of '\+', '-', '\*', got '/'"),
        ({"operations": []}, r"env\.arithmetic\.operations: must be a non-empty list"),
        ({"operations": ["+", "+"]}, r"env\.arithmetic\.operations: lists an operation twice"),
        ({"max_value": "20"}, r"env\.arithmetic\.max_value: expected int, got str \('20'\)"),
        ({"num_operands": 2.0}, r"env\.arithmetic\.num_operands: expected int, got float \(2\.0\)"),
        ({"allow_negative": "no"}, r"env\.arithmetic\.allow_negative: expected bool, got str \('no'\)"),
        (
            {"min_value": -1},
            r"env\.arithmetic\.min_value: -1 is negative while allow_negative is false",
        ),
        ({"operations": ["-"], "min_value": 8, "num_operands": 4}, r"env\.arithmetic: no problem without a negative"),
        (["+"], r"env\.arithmetic: expected a mapping \(ArithmeticTaskConfig\), got list"),
    ],
)
def test_arithmetic_settings_are_validated_with_dotted_paths(cfg, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(cfg)


def test_arithmetic_task_error_paths_follow_the_given_path_and_arguments_are_checked():
    with pytest.raises(ValueError, match=r"data\.val\.num_operands"):
        ArithmeticTask({"num_operands": 0}, path="data.val")
    with pytest.raises(ValueError, match="index must be an int"):
        ArithmeticTask().problem(0, "3")
    with pytest.raises(ValueError, match="count must be >= 0"):
        ArithmeticTask().problems(0, 0, -1)


def test_arithmetic_reward_is_exact_after_strip():
    env = ArithmeticEnvironment({"name": "arithmetic", "num_workers": 2, "math": {}, "arithmetic": {"max_value": 9}})
    assert env.name == "arithmetic" and env.task.max_value == 9
    completions = ["19", " 19\n", "19.0", "The answer is 19", "", "-19"]
    ret = env.score(["12+7="] * 6, completions, [{"ground_truth": "19"}] * 6)
    assert ret.rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert ret.infos[1] == {"correct": True, "extracted": "19", "answer": "19"}
    assert ret.infos[4] == {"correct": False, "extracted": None, "answer": None}
    # An integer ground truth (as data sets often store it) means the same text.
    assert env.score(["1+1="], ["2"], [{"ground_truth": 2}]).rewards == [1.0]


def test_arithmetic_environment_errors_name_the_sample_or_the_key():
    env = ArithmeticEnvironment()
    with pytest.raises(
        RewardError, match=r"sample 1 \(prompt '2\+2=', completion '4'\): metadata has no 'ground_truth'"
    ):
        env.score(["1+1=", "2+2="], ["2", "4"], [{"ground_truth": "2"}, {"answer": "4"}])
    with pytest.raises(ValueError, match="prompts=2, completions=1, metadata=2"):
        env.score(["1+1=", "2+2="], ["2"], [{}, {}])
    with pytest.raises(ValueError, match=r"env\.arithmetic\.max_value: expected int, got None"):
        ArithmeticEnvironment({"arithmetic": {"max_value": None}})
    with pytest.raises(
        ValueError, match=r"env\.arithmetic: expected a mapping \(ArithmeticTaskConfig\), got int \(5\)"
    ):
        ArithmeticEnvironment({"arithmetic": 5})


# ---------------------------------------------------------------------- math answers
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{3} then \boxed {x^{2}+1}", "x^{2}+1"),
        (r"\fbox{42}", "42"),
        (r"unclosed \boxed{7 and then 9", "9"),
        ("She has 5 apples.\n#### 72", "72"),
        ("#### $1,000.\nQuestion: next", "$1,000"),
        ("first 3 #### 4 then #### 18", "18"),
        ("It costs 1,234 dollars and 5 cents, so 1,234,567.", "1,234,567"),
        ("the temperature fell to -12 degrees", "-12"),
        ("from 3-4 apples", "4"),
        ("it is 2.75 or .5", ".5"),
        ("a 50% discount", "50%"),
        ("pay $18 now", "$18"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", 1234.0),
        ("$5", 5.0),
        ("\\$5.00", 5.0),
        ("3/4", 0.75),
        (r"\frac{3}{4}", 0.75),
        (r"\dfrac{3}{4}", 0.75),
        (r"-\frac{1}{2}", -0.5),
        ("50%", 50.0),
        ("-2.50", -2.5),
        ("72.", 72.0),
        (r"\text{18}", 18.0),
        ("1/0", None),
        ("x+1", None),
        ("nan", None),
        ("inf", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "predicted, truth, expected",
    [
        ("1,234", "1234", True),
        (r"\frac{1}{2}", "0.5", True),
        ("3/4", r"\dfrac{3}{4}", True),
        ("50%", "50", True),
        ("$18.00", "18", True),
        ("0", "0.0", True),
        ("18.001", "18", False),
        ("17", "18", False),
        (None, "18", False),
        ("x^{2} + 1", "x^{2}+1.", True),
        ("x+1", "x+2", False),
    ],
)
def test_answers_match(predicted, truth, expected):
    assert answers_match(predicted, truth) is expected


def test_answers_match_uses_the_relative_tolerance():
    assert answers_match("100.5", "100", rel_tol=0.01)
    assert not answers_match("100.5", "100", rel_tol=1e-3)


def test_ground_truth_answer():
    assert ground_truth_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert ground_truth_answer(r"Hence $\boxed{\frac{\pi}{2}}$.") == r"\frac{\pi}{2}"
    assert ground_truth_answer("  42 ") == "42"


def test_math_environment_scores_final_answers():
    env = MathEnvironment({"name": "math", "math": {"rel_tol": 1e-6}})
    completions = ["so it is 1,000.", r"\boxed{999}", "#### 1000", "I don't know"]
    metadata = [{"ground_truth": "Work...\n#### 1000"}] * 3 + [{"ground_truth": "1000"}]
    ret = env.score(["q"] * 4, completions, metadata)
    assert ret.rewards == [1.0, 0.0, 1.0, 0.0]
    assert ret.infos[0] == {"correct": True, "extracted": "1,000", "answer": "1000.0"}
    assert ret.infos[3] == {"correct": False, "extracted": None, "answer": None}
    # maj@k's votes: one answer however it is spelt, text answers normalised.
    assert [info["answer"] for info in ret.infos[:3]] == ["1000.0", "999.0", "1000.0"]
    texts = env.score(["q"] * 2, [r"\boxed{x + 1}", r"\boxed{x+1.}"], [{"ground_truth": "y"}] * 2)
    assert [info["answer"] for info in texts.infos] == ["x+1", "x+1"]


def test_math_environment_settings_are_validated():
    assert MathEnvironment().rel_tol == 1e-6
    with pytest.raises(ValueError, match=r"env\.math\.tolerance: unknown key"):
        MathEnvironment({"math": {"tolerance": 0.1}})
    with pytest.raises(ValueError, match=r"env\.math\.rel_tol: must be >= 0\.0, got -1"):
        MathEnvironment({"math": {"rel_tol": -1}})
    with pytest.raises(ValueError, match=r"env\.math\.rel_tol: must be a finite number >= 0, got inf"):
        MathEnvironment({"math": {"rel_tol": math.inf}})
    with pytest.raises(ValueError, match=r"env\.math\.rel_tol: must be >= 0\.0, got nan"):
        MathEnvironment({"math": {"rel_tol": math.nan}})
    with pytest.raises(RewardError, match="sample 0 .*metadata has no 'ground_truth'"):
        MathEnvironment().score(["q"], ["1"], [{}])


# ---------------------------------------------------------------------- reward checks
def test_check_environment_return_accepts_and_normalises_a_good_result():
    ret = check_environment_return(EnvironmentReturn((1, 0.5), [{}, {"a": 1}]), ["p", "q"], ["c", "d"], "e")
    assert ret.rewards == [1.0, 0.5] and all(type(r) is float for r in ret.rewards)
    assert ret.infos == [{}, {"a": 1}]


@pytest.mark.parametrize(
    "ret, message",
    [
        ({"rewards": [1.0]}, "environment 'toy': score\\(\\) must return an EnvironmentReturn, got dict"),
        (EnvironmentReturn([1.0, 1.0], [{}] * 3), r"expected 3 rewards \(one per sample, samples 5\.\.7\), got 2"),
        (EnvironmentReturn([1.0] * 3, [{}]), r"expected 3 infos \(one per sample, samples 5\.\.7\), got 1"),
        (
            EnvironmentReturn([1.0, 0.0, math.nan], [{}] * 3),
            r"sample 7 \(prompt 'prompt 2', completion 'completion 2'\): reward is nan; rewards must be finite",
        ),
        (EnvironmentReturn([math.inf, 0.0, 0.0], [{}] * 3), r"sample 5 .*: reward is inf"),
        (EnvironmentReturn([1.0, "1", 0.0], [{}] * 3), r"sample 6 .*: reward '1' of type str is not a real number"),
        (EnvironmentReturn([True, 0.0, 0.0], [{}] * 3), r"sample 5 .*: reward True of type bool"),
        (EnvironmentReturn([0.0] * 3, [{}, None, {}]), r"sample 6 .*: info must be a dict, got NoneType"),
    ],
)
def test_check_environment_return_rejects_bad_results(ret, message):
    prompts = [f"prompt {i}" for i in range(3)]
    completions = [f"completion {i}" for i in range(3)]
    with pytest.raises(RewardError, match=message):
        check_environment_return(ret, prompts, completions, "toy", offset=5)


def test_error_excerpts_of_long_texts_are_short():
    with pytest.raises(RewardError) as caught:
        check_environment_return(EnvironmentReturn([math.nan], [{}]), ["p" * 500], ["c" * 500], "toy")
    assert len(str(caught.value)) < 300 and "ppp..." in str(caught.value)


# ---------------------------------------------------------------------- registry
def test_make_environment_builds_the_builtins():
    assert set(BUILTIN_ENVIRONMENTS) == {"arithmetic", "math", "reasoning_gym", "tool_arithmetic"}
    env = make_environment({"name": "arithmetic", "arithmetic": {"num_operands": 3}})
    assert isinstance(env, ArithmeticEnvironment) and env.task.num_operands == 3
    assert isinstance(make_environment({"name": "math"}), MathEnvironment)


def test_make_environment_builds_a_user_class_by_import_path():
    env = make_environment({"name": "tests.unit.test_environments:ConstantEnv", "kwargs": {"value": 0.25}})
    assert env.name == "constant"
    assert env.score(["a", "b"], ["x", "y"], [{}, {}]).rewards == [0.25, 0.25]
    # Settings outside kwargs are not the user's to invent: the section refuses them by name.
    with pytest.raises(ValueError, match=r"env\.constant: unknown key \(known keys: name, num_workers, timeout_s,"):
        make_environment({"name": "tests.unit.test_environments:ConstantEnv", "constant": {"value": 0.25}})


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"name": "gsm9k"},
            r"env\.name: unknown environment 'gsm9k'; built-in environments: "
            r"\['arithmetic', 'math', 'reasoning_gym', 'tool_arithmetic'\]",
        ),
        ({}, r"env\.name: missing required key"),
        ({"name": 3}, r"env\.name: expected str, got int \(3\)"),
        ({"name": ""}, r"env\.name: .*got str \(''\)"),
        ({"name": "math", "timeout_s": 0}, r"env\.timeout_s: must be > 0\.0, got 0"),
        (
            {"name": "no_such_pkg.rewards:Env"},
            r"env\.name: cannot import module 'no_such_pkg\.rewards' .*ModuleNotFoundError",
        ),
        ({"name": "tests.unit.test_environments:Missing"}, r"has no class 'Missing' \(found nothing\)"),
        (
            {"name": "tests.unit.test_environments:NotAnEnvironment"},
            r"built a NotAnEnvironment, which is not an Environment",
        ),
        (
            {"name": "arithmetic", "arithmetic": {"max_value": -1}},
            r"env\.arithmetic\.min_value: 0 is greater than max_value \(-1\)",
        ),
    ],
)
def test_make_environment_rejects_bad_names(cfg, message):
    with pytest.raises(ValueError, match=message):
        make_environment(cfg)


def test_importing_environments_imports_no_framework():
    script = "import sys, core.environments; print([m for m in ('torch', 'jax', 'ray') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
