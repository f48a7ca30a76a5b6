"""A GRPO run's live parts, and the one choice a run makes about its steps: synchronous or async.

:class:`GRPORun` is what :mod:`core.algorithms.grpo` (the step), :mod:`core.algorithms.async_grpo`
(the two-thread schedule) and :mod:`core.algorithms.grpo_setup` (building and running it) share;
it lives apart from all three so that none of them imports another to know it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from core.algorithms.config import GRPORunConfig
from core.algorithms.training_run import TrainingRun

if TYPE_CHECKING:
    from core.algorithms.multi_turn import EpisodeRunner
    from core.algorithms.rollout_engine import RolloutEngine
    from core.environments import EnvironmentPool
    from core.losses import ClippedPGLossFn
    from core.policy import Policy


@dataclass
class GRPORun(TrainingRun):
    """A run plus GRPO's own live parts: the rollout engine and the reward environments."""

    cfg: GRPORunConfig  # (narrowed from TrainingRun's MasterConfig: a GRPO run's config)
    resolved_cfg: GRPORunConfig
    loss_fn: ClippedPGLossFn  # (narrowed: GRPO trains with the clipped policy gradient)
    rollouts: RolloutEngine | None = None
    env: EnvironmentPool | None = None
    #: A multi-turn environment's episodes, stepped in the EpisodePool's actors (env.num_workers
    #: >= 1) or on the driver (0); None: single-turn, the EnvironmentPool scores.
    episodes: EpisodeRunner | None = None
    #: Async runs only: validation's episodes, in an executor of their own (validation plays on
    #: the trainer's thread while the generation thread plays the next steps' episodes, and an
    #: executor holds the states of one rollout at a time).  Otherwise validation uses ``episodes``.
    val_episodes: EpisodeRunner | None = None
    #: The frozen distillation teacher (a Policy without an optimizer), with grpo.distillation.
    teacher: Policy | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (started with the workers)."""
        if self.rollouts is None:
            raise RuntimeError("the GRPO run's workers are not started: no rollout engine yet")
        return self.rollouts

    @property
    def scorer(self) -> EnvironmentPool:
        """The single-turn reward environments (started with the workers)."""
        if self.env is None:
            raise RuntimeError("the GRPO run has no environment pool (not started, or a multi-turn run)")
        return self.env


class StepSchedule(Protocol):
    """How a run's steps run -- synchronously (:class:`core.algorithms.grpo.SyncSchedule`) or
    with generation ahead of training (:class:`core.algorithms.async_grpo.AsyncGRPO`) -- chosen
    once per run (:func:`core.algorithms.grpo_setup.grpo_schedule`)."""

    def step(self, step: int) -> dict[str, float]:
        """One training step (1-based); its metrics."""
        ...

    def sync_weights(self) -> dict[str, float]:
        """Move the engines to the policy's current weights, as the schedule allows (what
        validation calls before it samples); the refit's metrics."""
        ...
