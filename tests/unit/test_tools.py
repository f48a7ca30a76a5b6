"""Tools of multi-turn environments: the tool-call parser, the calculator's safety, the
memory tool, the time limit, and ToolArithmeticEnvironment's steps (all in-process)."""

from __future__ import annotations

import time

import pytest

from core.environments.multi_turn import StepResult
from core.environments.tools import (
    CALCULATOR,
    MEMORY,
    Tool,
    ToolArithmeticEnvironment,
    ToolError,
    calculate,
    parse_tool_calls,
    run_tool,
)

TOOLS = {"calculator": CALCULATOR, "memory": MEMORY}


def _call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


# ------------------------------------------------------------------ parser
def test_valid_calls_are_all_parsed_in_order():
    message = (
        "think "
        + _call('{"name": "calculator", "arguments": {"expression": "2+3"}}')
        + " and "
        + _call('\n{"name": "memory", "arguments": {"action": "get", "key": "x"}}\n')
    )
    calls = parse_tool_calls(message, TOOLS)
    assert [(c.name, c.arguments, c.ok) for c in calls] == [
        ("calculator", {"expression": "2+3"}, True),
        ("memory", {"action": "get", "key": "x"}, True),
    ]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("the answer is 5", TOOLS) == []


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"name": "calculator", "arguments": {"expression": "2+3"}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"arguments": {}}', "needs a string 'name'"),
        ('{"name": "search", "arguments": {}}', "unknown tool 'search'; available tools: ['calculator', 'memory']"),
        ('{"name": "calculator", "arguments": {}}', "missing argument(s) ['expression']"),
        (
            '{"name": "calculator", "arguments": {"expression": 5}}',
            "argument 'expression' must be a string, got integer 5",
        ),
        ('{"name": "calculator", "arguments": {"expression": "1", "x": 1}}', "has no argument(s) ['x']"),
        ('{"name": "calculator", "arguments": "2+3"}', "'arguments' must be a JSON object"),
        ('{"name": "calculator", "args": {}}', "unknown key(s) ['args']"),
    ],
)
def test_malformed_calls_say_what_is_wrong(body, fragment):
    (call,) = parse_tool_calls(_call(body), TOOLS)
    assert not call.ok and fragment in call.problem


def test_unclosed_call():
    (call,) = parse_tool_calls('<tool_call>{"name": "calculator"}', TOOLS)
    assert call.problem == "<tool_call> without a closing </tool_call>"


# ------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    "expression, value",
    [("2+3*4", 14), ("(2+3)*4", 20), ("-7//2", -4), ("7%3", 1), ("2**10", 1024), ("1/4", 0.25), ("-(-3)", 3)],
)
def test_calculator_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("x + 1", "a name (x) is not allowed"),
        ("(1).real", "attribute access (.real) is not allowed"),
        ("abs(-1)", "a function call is not allowed"),
        ("[1][0]", "is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("2 ** 65", "exponent 65 is larger than 64"),
        ("10 ** 60 * 10 ** 60", "result larger than"),
        ("999999 ** 64", "would be larger than"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "invalid expression"),
        ("1" * 300, "longer than 256 characters"),
        ("True + 1", "only numbers are allowed"),
    ],
)
def test_calculator_refuses(expression, fragment):
    with pytest.raises(ToolError) as err:
        calculate(expression)
    assert fragment in str(err.value)


def test_calculator_tool_reports_errors_as_text():
    out, ok = run_tool(CALCULATOR, {"expression": "1/0"}, {}, timeout_s=5)
    assert (out, ok) == ("tool 'calculator' error: division by zero", False)
    assert run_tool(CALCULATOR, {"expression": "0.1+0.2"}, {}, timeout_s=5) == ("0.3", True)


# ------------------------------------------------------------------ memory, limits
def test_memory_persists_within_one_state_only():
    state: dict = {}
    assert run_tool(MEMORY, {"action": "set", "key": "x", "value": "42"}, state, 5) == ("stored 'x'", True)
    assert run_tool(MEMORY, {"action": "get", "key": "x"}, state, 5) == ("42", True)
    out, ok = run_tool(MEMORY, {"action": "get", "key": "x"}, {}, 5)
    assert not ok and "no value stored under 'x'" in out


def test_tool_over_its_time_limit_is_an_observation():
    slow = Tool("slow", "sleeps", lambda args, state: time.sleep(0.5) or "late")
    out, ok = run_tool(slow, {}, {}, timeout_s=0.05)
    assert (out, ok) == ("tool 'slow' exceeded its time limit of 0.05 s", False)


def test_a_crashing_tool_is_an_observation():
    def boom(args, state):
        raise KeyError("k")

    assert run_tool(Tool("boom", "", boom), {}, {}, 1) == ("tool 'boom' failed: KeyError: 'k'", False)


# ------------------------------------------------------------------ environment
def test_tool_arithmetic_episode():
    env = ToolArithmeticEnvironment({"name": "tool_arithmetic"})
    state = env.reset({"ground_truth": "391", "raw_prompt": "17*23="})
    step = env.step(state, _call('{"name": "calculator", "arguments": {"expression": "17*23"}}'))
    assert step == StepResult(
        "<tool_response>\n391\n</tool_response>",
        0.0,
        False,
        {"correct": False, "extracted": None, "answer": None, "tool_calls": 1, "malformed_tool_calls": 0},
    )
    bad = env.step(state, _call("{oops}"))
    assert not bad.done and bad.observation.startswith("<tool_response>\nerror: the tool call is not valid JSON")
    assert bad.info["malformed_tool_calls"] == 1
    final = env.step(state, " 391 ")
    assert (final.observation, final.reward, final.done, final.info["correct"]) == (None, 1.0, True, True)
    assert env.step(state, "390").reward == 0.0


def test_tool_settings_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        ToolArithmeticEnvironment({"name": "tool_arithmetic", "tools": {"timeout_s": 0}})
