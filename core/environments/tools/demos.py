"""Calculator-call demonstrations: the SFT data that warm-starts the built-in tool-use model.

The built-in source ``data.dataset_name: tool-arithmetic`` (SFT, ``data.messages_key:
messages``) is the arithmetic task's problems as conversations.  A share
``data.tool_demo_fraction`` of them (drawn per problem from ``(seed, index)``, so a row is as
reproducible as its problem) demonstrates the calculator::

    user       123*456+789=
    assistant  <tool_call>{"name":"calculator","arguments":{"expression":"123*456+789"}}</tool_call>
    tool       <tool_response>\\n56877\\n</tool_response>
    assistant  56877

the rest answer directly (``user 123*456+789=`` / ``assistant 56877``).  The call is the
format :mod:`core.environments.tools.parser` reads (compact JSON: fewest tokens), the tool
turn is exactly the observation ``ToolArithmeticEnvironment`` returns for it (the calculator's
own output), so a model trained on these rows writes calls the multi-turn rollout runs
unchanged.  Without a chat template the SFT encoder renders such a conversation as the
rollout does (docs/multi-turn.md): the loss is on the two assistant turns only.
"""

from __future__ import annotations

import json
import random
from typing import Any

from core.environments.tools.calculator import CALCULATOR
from core.environments.tools.environment import tool_response
from core.environments.tools.parser import CALL_CLOSE, CALL_OPEN

__all__ = ["ToolDemoTask", "calculator_call"]


def calculator_call(expression: str) -> str:
    """The assistant message that calls the calculator on ``expression`` (compact JSON)."""
    payload = {"name": CALCULATOR.name, "arguments": {"expression": expression}}
    return CALL_OPEN + json.dumps(payload, separators=(",", ":")) + CALL_CLOSE


class ToolDemoTask:
    """An arithmetic task's problems with a ``messages`` conversation each (module docstring)."""

    def __init__(self, task: Any, fraction: float | None, key: str = "data.tool_demo_fraction") -> None:
        if fraction is None or not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"{key}: the built-in source 'tool-arithmetic' needs the share of calculator-call "
                f"demonstrations, a number in [0, 1]; got {fraction!r}"
            )
        self.task, self.fraction = task, float(fraction)

    def problem(self, seed: int, index: int) -> dict[str, Any]:
        row: dict[str, Any] = dict(self.task.problem(seed, index))
        prompt, answer = row["prompt"], row["answer"]
        messages = [{"role": "user", "content": prompt}]
        if random.Random(f"tool-demo:{seed}:{index}").random() < self.fraction:
            expression = prompt.removesuffix("=")
            output = CALCULATOR.fn({"expression": expression}, {})
            messages += [
                {"role": "assistant", "content": calculator_call(expression)},
                {"role": "tool", "content": tool_response(output)},
            ]
        row["messages"] = messages + [{"role": "assistant", "content": answer}]
        return row

    def problems(self, seed: int, start: int, count: int) -> list[dict[str, Any]]:
        return [self.problem(seed, i) for i in range(start, start + count)]

    def num_distinct_problems(self) -> int:
        return int(self.task.num_distinct_problems())
