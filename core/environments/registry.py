"""``env.name`` -> an environment object: a built-in name or a user's ``module:Class``.

A user environment is any class implementing :class:`~core.environments.Environment`
whose constructor takes the whole ``env`` config section, an
:class:`~core.environments.config.EnvConfig` (its own settings are ``cfg.kwargs``); it is
named by import path, e.g. ``env.name: my_pkg.rewards:CodeEnv``.
The class must be importable where the environment runs (the Ray workers of an
:class:`~core.environments.EnvironmentPool` import it too).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from core.environments.arithmetic import ArithmeticEnvironment
from core.environments.config import EnvConfig
from core.environments.interfaces import Environment
from core.environments.math_verifier import MathEnvironment
from core.environments.multi_turn import MultiTurnEnvironment, is_multi_turn
from core.environments.reasoning_gym import ReasoningGymEnvironment
from core.environments.tools.environment import ToolArithmeticEnvironment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "environment_is_multi_turn",
    "make_environment",
    "make_multi_turn_environment",
    "resolve_environment_class",
]

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "arithmetic": ArithmeticEnvironment,
    "math": MathEnvironment,
    "tool_arithmetic": ToolArithmeticEnvironment,
    "reasoning_gym": ReasoningGymEnvironment,
}


def resolve_environment_class(name: Any) -> type:
    """The class ``env.name`` refers to (import errors become a ValueError naming it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"env.name must be a non-empty string, got {name!r}")
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(
            f"env.name: unknown environment {name!r}; built-in environments: "
            f"{sorted(BUILTIN_ENVIRONMENTS)}, or give a user class as 'package.module:ClassName'"
        )
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code, not just ImportError
        raise ValueError(
            f"env.name: cannot import module {module_name!r} of {name!r}: {type(err).__name__}: {err}"
        ) from err
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        found = "nothing" if cls is None else type(cls).__name__
        raise ValueError(f"env.name: {name!r}: module {module_name!r} has no class {class_name!r} (found {found})")
    return cls


def make_environment(env_cfg: EnvConfig | Mapping[str, Any]) -> Environment:
    """Build the environment ``env.name`` names, passing it the whole (typed) ``env`` section."""
    cfg = EnvConfig.coerce(env_cfg, "env")
    cls = resolve_environment_class(cfg.name)
    env = cls(cfg)
    if is_multi_turn(env) and not isinstance(env, Environment):
        raise ValueError(
            f"env.name: {cfg.name!r} is a multi-turn environment (reset/step), which `dualrl grpo` plays as "
            "episodes (grpo.max_rollout_turns); it has no score() for a reward pool"
        )
    if not isinstance(env, Environment):
        raise ValueError(
            f"env.name: {cfg.name!r} built a {type(env).__name__}, which is not an "
            f"Environment (it needs a `name` attribute and a `score(prompts, completions, metadata)` method)"
        )
    return env


def environment_is_multi_turn(name: Any) -> bool:
    """Whether ``env.name``'s class follows the multi-turn protocol (``reset`` / ``step``)."""
    return is_multi_turn(resolve_environment_class(name))


def make_multi_turn_environment(env_cfg: EnvConfig | Mapping[str, Any]) -> MultiTurnEnvironment:
    """Build the multi-turn environment ``env.name`` names (the whole ``env`` section passed)."""
    cfg = EnvConfig.coerce(env_cfg, "env")
    env = resolve_environment_class(cfg.name)(cfg)
    if not is_multi_turn(env) or not isinstance(getattr(env, "name", None), str):
        raise ValueError(
            f"env.name: {cfg.name!r} built a {type(env).__name__}, which is not a multi-turn environment "
            "(it needs a `name` attribute and `reset(metadata)` / `step(state, assistant_message)` methods)"
        )
    return env
