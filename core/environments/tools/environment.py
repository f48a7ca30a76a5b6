"""``ToolEnvironment``: an episode is a question; each turn the model calls tools or answers.

A turn with at least one ``<tool_call>`` runs every call (in order, each with the
``env.tools.timeout_s`` limit) and the observation is their outputs, each wrapped as
``<tool_response>...</tool_response>`` (a malformed call's response is the problem text);
reward 0, not done.  A turn with no ``<tool_call>`` is the final answer: the subclass's
``judge`` scores it (1.0 right, 0.0 wrong) and the episode ends.

Step infos: ``tool_calls`` and ``malformed_tool_calls`` (this turn's), and ``correct`` /
``extracted`` / ``answer`` as the single-turn environments report them (``correct`` is
False until a right final answer, so an episode cut off by the turn limit counts as wrong).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from core.environments.config import EnvConfig, ToolsConfig
from core.environments.interfaces import env_subsection
from core.environments.multi_turn import StepResult
from core.environments.tools.base import Tool, run_tool
from core.environments.tools.calculator import CALCULATOR
from core.environments.tools.parser import parse_tool_calls

__all__ = ["ToolArithmeticEnvironment", "ToolEnvironment", "tool_response"]


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


class ToolEnvironment(abc.ABC):
    """Question-answering with tools (see the module docstring); subclasses set ``tools``
    and ``judge``."""

    name = "tools"
    tools: tuple[Tool, ...] = ()

    def __init__(self, cfg: EnvConfig | Mapping[str, Any] | None = None) -> None:
        self.timeout_s = env_subsection(cfg, "tools", ToolsConfig).timeout_s
        self.tool_map = {tool.name: tool for tool in self.tools}

    @abc.abstractmethod
    def judge(self, answer: str, metadata: dict[str, Any]) -> tuple[bool, str | None]:
        """(is the final answer right, the answer read from it)."""

    def reset(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": metadata, "tool_state": {name: {} for name in self.tool_map}}

    def step(self, state: dict[str, Any], assistant_message: str) -> StepResult:
        calls = parse_tool_calls(assistant_message, self.tool_map)
        if not calls:
            correct, extracted = self.judge(assistant_message, state["metadata"])
            info = {"correct": correct, "extracted": extracted, "answer": extracted}
            return StepResult(None, 1.0 if correct else 0.0, True, {**info, "tool_calls": 0, "malformed_tool_calls": 0})
        responses = []
        for call in calls:
            if call.problem is not None or call.name is None:
                responses.append(tool_response(f"error: {call.problem}"))
                continue
            out, _ = run_tool(self.tool_map[call.name], call.arguments, state["tool_state"][call.name], self.timeout_s)
            responses.append(tool_response(out))
        malformed = sum(not call.ok for call in calls)
        info = {"correct": False, "extracted": None, "answer": None}
        return StepResult(
            "\n".join(responses), 0.0, False, {**info, "tool_calls": len(calls), "malformed_tool_calls": malformed}
        )


class ToolArithmeticEnvironment(ToolEnvironment):
    """The built-in tool task (``env.name: tool_arithmetic``): the arithmetic problems of
    ``env.arithmetic`` (core/configs/grpo_tool_arithmetic.yaml makes them harder than the
    embedded task's: more operands, bigger numbers), the ``calculator`` tool, and the
    arithmetic task's exact-answer check of the final message."""

    name = "tool_arithmetic"
    tools = (CALCULATOR,)

    def __init__(self, cfg: EnvConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        from core.environments.arithmetic import ArithmeticEnvironment

        self._answers = ArithmeticEnvironment(cfg)  # validates env.arithmetic now, not mid-run

    def judge(self, answer: str, metadata: dict[str, Any]) -> tuple[bool, str | None]:
        if "ground_truth" not in metadata:
            raise ValueError(f"metadata has no 'ground_truth' (got {sorted(metadata)})")
        return self._answers.judge(answer, str(metadata["ground_truth"]))
