"""The reward protocol every environment implements, and the check applied to its output.

An environment turns ``(prompt, completion, metadata)`` triples into one scalar reward
each (plus a free-form ``info`` dict per sample, logged by the training loop).  The GRPO
loop never trusts an environment's output blindly: :func:`check_environment_return` runs
on every result, because a single NaN reward silently poisons the advantages of a whole
group and only shows up steps later as a NaN loss.

Nothing here imports torch, jax or ray.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from core.config import ConfigModel
from core.environments.config import EnvConfig

M = TypeVar("M", bound=ConfigModel)

__all__ = [
    "AnswerCheckingEnvironment",
    "EnvironmentReturn",
    "Environment",
    "RewardError",
    "check_environment_return",
    "excerpt",
    "describe_sample",
    "check_batch_lengths",
    "ground_truth_of",
    "env_subsection",
]

#: How many characters of a prompt / completion an error message quotes.
EXCERPT_CHARS = 60


@dataclass
class EnvironmentReturn:
    """What :meth:`Environment.score` returns: one reward and one info dict per sample.

    The built-in environments put ``{"correct": bool, "extracted": str | None, "answer": str |
    None}`` in each info dict: whether the sample is right, the answer read from it, and that
    answer in a comparable form (two samples give the same answer iff their ``answer`` is
    equal; maj@k votes on it, None abstains).  User environments may put anything picklable
    there; pass@k / mean@k need ``correct``, maj@k also ``answer``.
    """

    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class Environment(Protocol):
    """A reward function over a batch of samples (all three lists have the same length)."""

    name: str

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        metadata: list[dict[str, Any]],
    ) -> EnvironmentReturn:
        """Reward ``completions[i]`` given ``prompts[i]`` and ``metadata[i]`` (e.g. the
        ``ground_truth``)."""
        ...


class AnswerCheckingEnvironment(abc.ABC):
    """An environment that scores each sample alone: right (1.0) or wrong (0.0) against the
    sample's ``ground_truth``.  Subclasses say how an answer is read and compared."""

    name = "answer-checking"

    @abc.abstractmethod
    def judge(self, completion: str, ground_truth: str) -> tuple[bool, str | None]:
        """(is the completion right, the answer read from it): each task has its own rule."""

    def comparable(self, extracted: str | None) -> str | None:
        """The extracted answer in the form two equal answers share (``info["answer"]``, what
        maj@k votes on): here the answer itself; a task that accepts several spellings of one
        answer (``1,000`` and ``1000``) maps them to one."""
        return extracted

    def score(self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch_lengths(prompts, completions, metadata)
        rewards: list[float] = []
        infos: list[dict[str, Any]] = []
        for i, (prompt, completion, meta) in enumerate(zip(prompts, completions, metadata, strict=True)):
            correct, extracted = self.judge(completion, ground_truth_of(meta, i, prompt, completion, self.name))
            rewards.append(1.0 if correct else 0.0)
            infos.append({"correct": correct, "extracted": extracted, "answer": self.comparable(extracted)})
        return EnvironmentReturn(rewards=rewards, infos=infos)


class RewardError(RuntimeError):
    """A reward could not be computed, or the environment returned something unusable.

    The message names the sample (its index in the whole batch, not in a chunk) and the
    cause, so a user can find the offending completion in the rollout log.
    """


def excerpt(text: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr`` of ``text`` cut to about ``limit`` characters (for error messages)."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    return repr(text)


def describe_sample(index: int, prompt: Any, completion: Any) -> str:
    """``sample 7 (prompt '12+7=', completion '19')`` -- how every error names a sample."""
    return f"sample {index} (prompt {excerpt(prompt)}, completion {excerpt(completion)})"


def check_environment_return(
    ret: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    env_name: str,
    offset: int = 0,
) -> EnvironmentReturn:
    """Validate what environment ``env_name`` returned for ``prompts``/``completions``.

    ``offset`` is the index of ``prompts[0]`` in the whole batch (a pool scores chunks),
    so that messages name global sample indices.  Returns an :class:`EnvironmentReturn`
    whose rewards are plain Python floats and whose lists are plain lists.

    Raises:
        RewardError: ``ret`` is not an EnvironmentReturn; it holds the wrong number of
            rewards or infos; an info is not a dict; a reward is not a finite real number.
    """
    where = f"environment {env_name!r}"
    if not isinstance(ret, EnvironmentReturn):
        raise RewardError(f"{where}: score() must return an EnvironmentReturn, got {type(ret).__name__}")
    expected = len(prompts)
    for field_name in ("rewards", "infos"):
        values = getattr(ret, field_name)
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"{where}: EnvironmentReturn.{field_name} must be a list, got {type(values).__name__}")
        if len(values) != expected:
            last = offset + expected - 1
            raise RewardError(
                f"{where}: expected {expected} {field_name} (one per sample, samples "
                f"{offset}..{last}), got {len(values)}"
            )
    rewards = [_checked_reward(r, offset + i, prompts[i], completions[i], where) for i, r in enumerate(ret.rewards)]
    for i, info in enumerate(ret.infos):
        if not isinstance(info, dict):
            sample = describe_sample(offset + i, prompts[i], completions[i])
            raise RewardError(f"{where}: {sample}: info must be a dict, got {type(info).__name__}")
    return EnvironmentReturn(rewards=rewards, infos=list(ret.infos))


def _checked_reward(value: Any, index: int, prompt: str, completion: str, where: str) -> float:
    """``value`` as a float, or a RewardError naming the sample and the value."""
    # bool is an int subclass; a True/False reward is almost always a forgotten float().
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_real:
        problem = f"reward {value!r} of type {type(value).__name__} is not a real number"
    elif not math.isfinite(float(value)):
        problem = f"reward is {float(value)!r}; rewards must be finite"
    else:
        return float(value)
    raise RewardError(f"{where}: {describe_sample(index, prompt, completion)}: {problem}")


# ------------------------------------------------------------ helpers for environments
def check_batch_lengths(prompts: Sequence[Any], completions: Sequence[Any], metadata: Sequence[Any]) -> None:
    """ValueError unless the three per-sample lists have the same length."""
    lengths = {"prompts": len(prompts), "completions": len(completions), "metadata": len(metadata)}
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"score() needs one prompt, completion and metadata dict per sample; got {detail}")


def ground_truth_of(meta: Any, index: int, prompt: Any, completion: Any, env_name: str) -> str:
    """``meta["ground_truth"]`` as a string, or a RewardError naming the sample."""
    if not isinstance(meta, dict) or "ground_truth" not in meta:
        got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise RewardError(
            f"environment {env_name!r}: {describe_sample(index, prompt, completion)}: "
            f"metadata has no 'ground_truth' (got {got})"
        )
    # Data sets store integer answers as ints as often as strings; both mean the same text.
    return str(meta["ground_truth"])


def env_subsection(env_cfg: Any, key: str, model: type[M]) -> M:
    """A built-in environment's own settings ``env.<key>`` as ``model`` (its defaults when
    absent), from the whole ``env`` section: an :class:`EnvConfig` or the plain mapping of one
    (each environment reads only its own sub-section: ``env.arithmetic``, ``env.math``, ...)."""
    if env_cfg is None:
        section = None
    elif isinstance(env_cfg, EnvConfig):
        section = getattr(env_cfg, key)
    elif isinstance(env_cfg, Mapping):
        section = env_cfg.get(key)
    else:
        raise ValueError(f"env: expected a mapping, got {type(env_cfg).__name__}")
    return model.coerce({} if section is None else section, f"env.{key}")
