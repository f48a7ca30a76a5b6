"""The ``memory`` tool: a key-value store that lasts one episode (every turn of it).

``{"name": "memory", "arguments": {"action": "set", "key": "x", "value": "42"}}`` stores,
``{"action": "get", "key": "x"}`` reads back.  The store lives in the episode's state, so
two episodes never see each other's keys.  Bounded: ``MAX_KEYS`` keys, ``MAX_VALUE_CHARS``
characters per value.
"""

from __future__ import annotations

from typing import Any

from core.environments.tools.base import Tool, ToolError

__all__ = ["MAX_KEYS", "MAX_VALUE_CHARS", "MEMORY"]

MAX_KEYS = 64
MAX_VALUE_CHARS = 1024


def _memory(arguments: dict[str, Any], state: dict[str, Any]) -> str:
    store: dict[str, str] = state.setdefault("store", {})
    action, key = arguments["action"], arguments["key"]
    if action == "get":
        if key not in store:
            raise ToolError(f"no value stored under {key!r} (stored keys: {sorted(store)})")
        return store[key]
    if action != "set":
        raise ToolError(f"action must be 'set' or 'get', got {action!r}")
    value = arguments.get("value")
    if value is None:
        raise ToolError("action 'set' needs a string 'value'")
    if len(value) > MAX_VALUE_CHARS:
        raise ToolError(f"value longer than {MAX_VALUE_CHARS} characters")
    if key not in store and len(store) >= MAX_KEYS:
        raise ToolError(f"memory full ({MAX_KEYS} keys)")
    store[key] = value
    return f"stored {key!r}"


MEMORY = Tool(
    name="memory",
    description="Remember text across turns: action 'set' (key, value) or 'get' (key).",
    fn=_memory,
    required={"action": str, "key": str},
    optional={"value": str},
)
