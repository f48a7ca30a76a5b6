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
BUILTIN_ENVIRONMENT_NAMES = ("arithmetic", "math", "tool_arithmetic", "reasoning_gym")
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


class ReasoningGymTaskConfig(ConfigModel):
    """One reasoning-gym task of a mix (core.environments.reasoning_gym)."""

    name: str = Field(min_length=1)
    """The task's reasoning-gym name, e.g. "spell_backward" (reasoning_gym.factory.DATASETS)."""
    weight: float = Field(1.0, gt=0)
    """Its share of the mix: each problem's task is drawn with probability weight / sum of weights."""
    seed: int = 0
    """The task generator's own seed; the run's seed (train) or data.val_seed (held out) picks
    a region of its problems that no other seed reaches."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """The task's generator settings (its reasoning-gym config fields, e.g. min_word_len); the
    task's defaults for those left out."""

    def check(self) -> Iterable[Problem]:
        if not math.isfinite(self.weight):
            yield "weight", f"must be a finite number > 0, got {self.weight!r}"
        # The generator's seed is this entry's own key, and the stream is infinite (reasoning-gym's
        # ``size`` is a virtual length nothing here reads).
        for key in ("seed", "size"):
            if key in self.settings:
                where = "the entry's own `seed` key" if key == "seed" else "nothing (the problem stream is infinite)"
                yield f"settings.{key}", f"not a setting here: it is set by {where}; remove it"


class ReasoningGymConfig(ConfigModel):
    """Problems of reasoning-gym tasks (``data.dataset_name: reasoning_gym``): one task or a
    weighted mix, each with its own generator settings and seed."""

    tasks: list[ReasoningGymTaskConfig] = Field(min_length=1)
    """The tasks of the mix (names distinct: metrics are reported per task name)."""

    def check(self) -> Iterable[Problem]:
        names = [task.name for task in self.tasks]
        for i, name in enumerate(names):
            if name in names[:i]:
                yield f"tasks[{i}].name", f"{name!r} is listed twice; give each task one entry"
        # The names and settings against reasoning-gym itself (imported only here, lazily).
        from core.environments.reasoning_gym_checks import task_problems

        yield from task_problems(self.tasks)


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
    """"arithmetic" | "math" | "tool_arithmetic" (multi-turn) | "reasoning_gym" (each task's own
    score_answer; the rows name their task) | "package.module:ClassName"."""
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
        if self.name == "reasoning_gym":
            yield from self._reasoning_gym_problems()

    def _reasoning_gym_problems(self) -> Iterable[Problem]:
        """The reasoning-gym scorer reads its tasks from the rows, and needs the package."""
        for key in ("arithmetic", "math", "tools"):
            if getattr(self, key) is not None:
                yield key, "not read by env.name 'reasoning_gym' (each row names its task and settings); remove it"
        from core.environments.reasoning_gym_checks import missing_package

        missing = missing_package()
        if missing:
            yield "name", missing
