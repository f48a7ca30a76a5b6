"""The ``env`` section: which reward environment scores the rollouts, and its settings.

A built-in environment reads its own sub-section (``env.arithmetic``, ``env.math``); a
user's class (``env.name: package.module:ClassName``) gets the whole section and reads
``env.kwargs``.  Nothing here imports an environment.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from core.config import ConfigModel, Problem

#: The built-in environments (core.environments.registry.BUILTIN_ENVIRONMENTS).
BUILTIN_ENVIRONMENT_NAMES = ("arithmetic", "math", "tool_arithmetic")
#: The built-in environments that are multi-turn (core.environments.multi_turn).
BUILTIN_MULTI_TURN_NAMES = ("tool_arithmetic",)
#: What a multi-turn rollout does when a step raises, overruns env.timeout_s or returns an
#: invalid result: stop the run (fail) or end that episode with the reward it has (end_episode).
EpisodeErrorPolicy = Literal["fail", "end_episode"]
ArithmeticOperation = Literal["+", "-", "*"]
SUPPORTED_OPERATIONS: tuple[ArithmeticOperation, ...] = ("+", "-", "*")


def _default_operations() -> list[ArithmeticOperation]:
    return ["+", "-"]


class ArithmeticTaskConfig(ConfigModel):
    """Difficulty knobs of the built-in arithmetic task."""

    min_value: int = 0
    """Smallest operand."""
    max_value: int = 20
    """Largest operand."""
    num_operands: int = Field(2, ge=2)
    """Operands per problem."""
    operations: list[ArithmeticOperation] = Field(default_factory=_default_operations)
    """Drawn uniformly per operator; "*" binds tighter than "+" / "-"."""
    allow_negative: bool = False
    """Whether operands, intermediate totals and answers may be negative."""

    def check(self) -> Iterable[Problem]:
        if self.min_value > self.max_value:
            yield "min_value", f"{self.min_value} is greater than max_value ({self.max_value})"
        if self.min_value < 0 and not self.allow_negative:
            yield "min_value", f"{self.min_value} is negative while allow_negative is false"
        if not self.operations:
            yield "operations", f"must be a non-empty list drawn from {list(SUPPORTED_OPERATIONS)}"
        elif len(set(self.operations)) != len(self.operations):
            yield "operations", f"lists an operation twice: {self.operations}"


class MathEnvConfig(ConfigModel):
    """The math-answer verifier (last number / \\boxed{} extraction, numeric equality)."""

    rel_tol: float = Field(1e-6, ge=0)
    """Relative tolerance of the numeric comparison."""

    def check(self) -> Iterable[Problem]:
        if not math.isfinite(self.rel_tol):
            yield "rel_tol", f"must be a finite number >= 0, got {self.rel_tol!r}"


class ToolsConfig(ConfigModel):
    """The tools of a tool environment (``env.tools``; core.environments.tools)."""

    timeout_s: float = Field(5.0, gt=0)
    """Time limit of one tool call; a call over it gets an observation saying so."""

    def check(self) -> Iterable[Problem]:
        if not math.isfinite(self.timeout_s):
            yield "timeout_s", f"must be a number of seconds > 0, got {self.timeout_s!r}"


class EnvConfig(ConfigModel):
    """The reward environment, run in a pool of Ray actors."""

    name: str = Field(min_length=1)
    """"arithmetic" | "math" | "tool_arithmetic" (multi-turn) | "package.module:ClassName"."""
    num_workers: int = Field(1, ge=0)
    """Reward actors (Ray, num_cpus=0).  A multi-turn environment's episodes are pinned to
    them; 0 steps them in-process on the driver instead (multi-turn only)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one scoring call (a multi-turn environment: of one episode's step)."""
    on_episode_error: EpisodeErrorPolicy = "fail"
    """Multi-turn only: a step that raises, overruns timeout_s or returns an invalid result
    stops the run (fail) or ends its episode with the reward so far, counted in
    multi_turn/episode_errors (end_episode)."""
    arithmetic: ArithmeticTaskConfig | None = None
    math: MathEnvConfig | None = None
    tools: ToolsConfig | None = None
    """Tool settings of a tool environment (tool_arithmetic, or a user's ToolEnvironment)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings of a user's own environment class."""

    def check(self) -> Iterable[Problem]:
        # A user's class gets the whole section and may read anything; a built-in reads its own keys.
        if self.name in BUILTIN_ENVIRONMENT_NAMES and self.kwargs:
            yield (
                "kwargs",
                f"{self.kwargs!r}: not read by the built-in environment {self.name!r} (it is for a "
                "user's own class, env.name: package.module:ClassName); remove it",
            )
        if self.name in ("arithmetic", "tool_arithmetic") and self.math is not None:
            yield "math", f"not read by env.name {self.name!r} (these are the math verifier's settings); remove it"
        if self.name in ("arithmetic", "math") and self.tools is not None:
            yield "tools", f"not read by env.name {self.name!r}, which has no tools; remove it"
        if not math.isfinite(self.timeout_s):
            yield "timeout_s", f"must be a number of seconds > 0, got {self.timeout_s!r}"
