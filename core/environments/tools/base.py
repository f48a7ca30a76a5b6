"""A tool: a name, typed arguments, a function over them and the episode's scratch state.

Tools never raise into the rollout.  :func:`run_tool` turns every failure -- a
:class:`ToolError` the tool raised on purpose (division by zero), any other exception, or
a call that overran its time limit -- into the text the model sees next, so that it can
learn from it.

The time limit is enforced with a daemon thread and ``join(timeout)`` (no signals: rollouts
may run off the main thread).  A thread cannot be killed, so a tool over its limit keeps
running in the background until it returns; the built-in tools are bounded (the
calculator caps exponents and result sizes) and never get there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.environments.episodes import guarded_call

__all__ = ["Tool", "ToolError", "run_tool"]


class ToolError(Exception):
    """A tool refused its input; the message is shown to the model as is."""


@dataclass(frozen=True)
class Tool:
    """One tool the model may call as ``{"name": name, "arguments": {...}}``."""

    name: str
    description: str
    fn: Callable[[dict[str, Any], dict[str, Any]], str]
    """``fn(arguments, episode_state) -> output text``; ``episode_state`` is a dict private
    to this tool in this episode (the memory tool keeps its store there)."""
    required: Mapping[str, type] = field(default_factory=dict)
    """Argument name -> type every call must give."""
    optional: Mapping[str, type] = field(default_factory=dict)
    """Argument name -> type a call may give."""

    def argument_problem(self, arguments: Any) -> str | None:
        """What is wrong with ``arguments`` (missing, unexpected or mistyped), or None."""
        if not isinstance(arguments, dict):
            return f"'arguments' must be a JSON object, got {_json_type(arguments)}"
        missing = [k for k in self.required if k not in arguments]
        if missing:
            return f"tool {self.name!r} is missing argument(s) {missing}"
        unexpected = [k for k in arguments if k not in self.required and k not in self.optional]
        if unexpected:
            known = sorted([*self.required, *self.optional])
            return f"tool {self.name!r} has no argument(s) {unexpected} (it takes {known})"
        for key, value in arguments.items():
            expected = self.required.get(key) or self.optional[key]
            if not isinstance(value, expected) or isinstance(value, bool) and expected is not bool:
                return (
                    f"tool {self.name!r}: argument {key!r} must be a {_TYPE_NAMES.get(expected, expected.__name__)}, "
                    f"got {_json_type(value)}"
                )
        return None


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(value: Any) -> str:
    """``value``'s JSON type name, with the value (for messages to the model)."""
    kind = "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{kind} {value!r}" if kind != "object" else "an object"


def run_tool(tool: Tool, arguments: dict[str, Any], state: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
    """``(output text, ok)``: the tool's output, or the text saying why there is none."""
    outcome = guarded_call(lambda: tool.fn(arguments, state), timeout_s, "tool", thread_name=f"tool-{tool.name}")
    if outcome.timed_out:
        return f"tool {tool.name!r} exceeded its time limit of {timeout_s:g} s", False
    if isinstance(outcome.cause, ToolError):
        return f"tool {tool.name!r} error: {outcome.cause}", False
    if outcome.cause is not None:  # a bug in a tool must not end the run; the model sees it
        return f"tool {tool.name!r} failed: {type(outcome.cause).__name__}: {outcome.cause}", False
    out = outcome.value
    if not isinstance(out, str):
        return f"tool {tool.name!r} failed: it returned {type(out).__name__}, not text", False
    return out, True
