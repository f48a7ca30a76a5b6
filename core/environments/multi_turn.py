"""Multi-turn environments: a stateful episode per prompt, stepped once per assistant turn.

Protocol (shaped after NeMo RL's ``EnvironmentInterface.step`` and SkyRL-gym's
``BaseTextEnv.step``, reduced to what dualrl's rollouts need)::

    state = env.reset(metadata)                   # one episode, e.g. metadata["ground_truth"]
    result = env.step(state, assistant_message)   # -> StepResult(observation, reward, done, info)

``state`` is whatever the environment wants (it is handed back unchanged, so it may be
mutated in place); the rollout owns one per episode and never looks inside.  An episode
ends when a step says ``done`` (its ``observation`` may then be None), or when the rollout
stops it (``grpo.max_rollout_turns``, the sequence limit, an error).  A step that is not
done must return an observation: it is what the model sees before its next turn.

Single-turn ``score`` environments keep their own path in GRPO;
:class:`SingleTurnEpisodes` runs one as one-step episodes for code that handles both.

Nothing here imports torch, jax or ray.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from core.environments.interfaces import Environment, RewardError, check_environment_return

__all__ = [
    "EpisodeError",
    "MultiTurnEnvironment",
    "SingleTurnEpisodes",
    "StepResult",
    "check_step_result",
    "is_multi_turn",
]


@dataclass
class StepResult:
    """What one ``step`` returns."""

    observation: str | None
    """The text the model sees next (a tool's output, feedback); None only when ``done``."""
    reward: float
    """This step's reward; an episode's reward is the sum over its steps."""
    done: bool
    """The episode is over (a final answer was given)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form, logged; the last step's info is the episode's (``correct`` / ``answer``
    as in :class:`~core.environments.EnvironmentReturn` for accuracy and maj@k)."""


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An environment whose episodes last several assistant turns."""

    name: str

    def reset(self, metadata: dict[str, Any]) -> Any:
        """A fresh episode's state for the prompt whose metadata this is."""
        ...

    def step(self, state: Any, assistant_message: str) -> StepResult:
        """Advance the episode by one assistant message."""
        ...


class EpisodeError(RewardError):
    """A step raised, overran its deadline, or returned an unusable result; the message
    names the episode (its row in the rollout batch), the turn and the field."""


def is_multi_turn(env_or_class: Any) -> bool:
    """Whether an environment (class or object) follows the multi-turn protocol."""
    return callable(getattr(env_or_class, "reset", None)) and callable(getattr(env_or_class, "step", None))


def check_step_result(result: Any, episode: int, turn: int, env_name: str) -> StepResult:
    """``result`` with a plain float reward, or an :class:`EpisodeError` naming the episode,
    the turn and the field that is wrong."""
    where = f"environment {env_name!r}: episode {episode}, turn {turn}"
    if not isinstance(result, StepResult):
        raise EpisodeError(f"{where}: step() must return a StepResult, got {type(result).__name__}")
    reward = result.reward
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool):
        raise EpisodeError(f"{where}: field 'reward': {reward!r} of type {type(reward).__name__} is not a real number")
    if not math.isfinite(float(reward)):
        raise EpisodeError(f"{where}: field 'reward' is {float(reward)!r}; rewards must be finite")
    if not isinstance(result.done, bool):
        raise EpisodeError(f"{where}: field 'done' must be a bool, got {type(result.done).__name__}")
    if not isinstance(result.info, dict):
        raise EpisodeError(f"{where}: field 'info' must be a dict, got {type(result.info).__name__}")
    obs = result.observation
    if obs is not None and not isinstance(obs, str):
        raise EpisodeError(f"{where}: field 'observation' must be a str or None, got {type(obs).__name__}")
    if obs is None and not result.done:
        raise EpisodeError(
            f"{where}: field 'observation' is None but done is False: a continuing episode needs an "
            "observation (what the model sees before its next turn)"
        )
    return StepResult(obs, float(reward), result.done, result.info)


class SingleTurnEpisodes:
    """A ``score`` environment as one-step episodes: the first assistant message is scored
    (against ``metadata["raw_prompt"]``, the prompt text the data sets record) and ends the
    episode."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.name = env.name

    def reset(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return metadata

    def step(self, state: dict[str, Any], assistant_message: str) -> StepResult:
        prompt = str(state.get("raw_prompt", ""))
        ret = self.env.score([prompt], [assistant_message], [state])
        checked = check_environment_return(ret, [prompt], [assistant_message], self.name)
        return StepResult(None, checked.rewards[0], True, checked.infos[0])
