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
BUILTIN_ENVIRONMENT_NAMES = ("arithmetic", "math")
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


class EnvConfig(ConfigModel):
    """The reward environment, run in a pool of Ray actors."""

    name: str = Field(min_length=1)
    """"arithmetic" | "math" | "package.module:ClassName"."""
    num_workers: int = Field(1, ge=1)
    """Reward actors."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one scoring call."""
    arithmetic: ArithmeticTaskConfig | None = None
    math: MathEnvConfig | None = None
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
        if self.name == "arithmetic" and self.math is not None:
            yield "math", "not read by env.name 'arithmetic' (these are the math verifier's settings); remove it"
        if not math.isfinite(self.timeout_s):
            yield "timeout_s", f"must be a number of seconds > 0, got {self.timeout_s!r}"
