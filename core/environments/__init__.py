"""Reward environments: the protocol, the built-in tasks, and a Ray pool that runs them.

* :class:`Environment` / :class:`EnvironmentReturn` -- ``score(prompts, completions,
  metadata) -> EnvironmentReturn(rewards, infos)``; :func:`check_environment_return`
  validates any environment's output (count, finite rewards) and raises
  :class:`RewardError` naming the sample.
* :class:`ArithmeticTask` / :class:`ArithmeticEnvironment` -- ``"12+7="`` problems generated
  from (settings, seed, index), exact-answer reward (``env.arithmetic``).
* :class:`MathEnvironment` and :func:`extract_answer`, :func:`answers_match`, ... --
  GSM8K/MATH-style final-answer checking (``env.math``).
* :func:`make_environment` -- ``env.name`` (a built-in or ``package.module:Class``) -> object.
* :class:`EnvironmentPool` -- the environment in ``env.num_workers`` Ray actors.

Importing this package imports neither torch, jax nor ray (the pool imports ray lazily).
"""

from core.environments.arithmetic import ArithmeticEnvironment, ArithmeticTask
from core.environments.interfaces import (
    AnswerCheckingEnvironment,
    Environment,
    EnvironmentReturn,
    RewardError,
    check_environment_return,
)
from core.environments.math_verifier import (
    MathEnvironment,
    answers_match,
    extract_answer,
    ground_truth_answer,
    normalize_number,
)
from core.environments.pool import EnvironmentPool, EnvironmentPoolError
from core.environments.registry import BUILTIN_ENVIRONMENTS, make_environment

__all__ = [
    "AnswerCheckingEnvironment",
    "Environment",
    "EnvironmentReturn",
    "RewardError",
    "check_environment_return",
    "ArithmeticTask",
    "ArithmeticEnvironment",
    "MathEnvironment",
    "extract_answer",
    "normalize_number",
    "answers_match",
    "ground_truth_answer",
    "BUILTIN_ENVIRONMENTS",
    "make_environment",
    "EnvironmentPool",
    "EnvironmentPoolError",
]
