"""Tool calls in an assistant message: the Hermes / Qwen convention.

A call is ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``
(whitespace around the JSON allowed).  Every call of a message is parsed, in order, and the
environment runs them all (a model may batch independent calls in one turn).  A message
with no ``<tool_call>`` at all is a final answer.

A malformed call never raises: it becomes a :class:`ParsedCall` whose ``problem`` says
exactly what is wrong (unclosed tag, bad JSON, not an object, no / unknown tool name,
missing or mistyped arguments), and that text is the model's next observation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.environments.tools.base import Tool

__all__ = ["CALL_CLOSE", "CALL_OPEN", "ParsedCall", "parse_tool_calls"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One call: a tool and its checked arguments, or the problem that stops it."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def parse_tool_calls(message: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
    """Every ``<tool_call>`` of ``message`` checked against ``tools`` (empty: no call)."""
    calls: list[ParsedCall] = []
    pos = message.find(CALL_OPEN)
    while pos >= 0:
        start = pos + len(CALL_OPEN)
        end = message.find(CALL_CLOSE, start)
        if end < 0:
            calls.append(ParsedCall(None, problem=f"{CALL_OPEN} without a closing {CALL_CLOSE}"))
            break
        calls.append(_parse_one(message[start:end], tools))
        pos = message.find(CALL_OPEN, end + len(CALL_CLOSE))
    return calls


def _parse_one(body: str, tools: Mapping[str, Tool]) -> ParsedCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return ParsedCall(None, problem=f"the tool call is not valid JSON: {err.msg} at character {err.pos}")
    if not isinstance(payload, dict):
        return ParsedCall(None, problem=f"the tool call must be a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str):
        return ParsedCall(None, problem="the tool call needs a string 'name'")
    extra = sorted(set(payload) - {"name", "arguments"})
    if extra:
        return ParsedCall(name, problem=f"the tool call has unknown key(s) {extra} (it takes 'name' and 'arguments')")
    tool = tools.get(name)
    if tool is None:
        return ParsedCall(name, problem=f"unknown tool {name!r}; available tools: {sorted(tools)}")
    arguments = payload.get("arguments", {})
    problem = tool.argument_problem(arguments)
    return ParsedCall(name, arguments if problem is None else {}, problem)
