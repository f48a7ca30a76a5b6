"""Tools for multi-turn environments: the Hermes/Qwen ``<tool_call>`` parser, the tool
runner (time limit, errors as observations), the built-in ``calculator`` and ``memory``
tools, and :class:`ToolEnvironment` with the built-in ``tool_arithmetic`` task.
docs/multi-turn.md describes the format."""

from core.environments.tools.base import Tool, ToolError, run_tool
from core.environments.tools.calculator import CALCULATOR, calculate
from core.environments.tools.environment import ToolArithmeticEnvironment, ToolEnvironment, tool_response
from core.environments.tools.memory import MEMORY
from core.environments.tools.parser import ParsedCall, parse_tool_calls

__all__ = [
    "CALCULATOR",
    "MEMORY",
    "ParsedCall",
    "Tool",
    "ToolArithmeticEnvironment",
    "ToolEnvironment",
    "ToolError",
    "calculate",
    "parse_tool_calls",
    "run_tool",
    "tool_response",
]
