"""Where a multi-turn environment's episodes live: their states, and the calls that step them.

The rollout (:class:`core.algorithms.multi_turn.EpisodeRunner`) never holds an episode's
state: it hands every live episode's assistant message to an :class:`EpisodeExecutor` each
turn, in one call, and gets one :class:`Outcome` per episode back.  Two executors:

* :class:`InProcessEpisodes` (``env.num_workers: 0``): the states in a dict on the driver;
* :class:`~core.environments.episode_pool.EpisodePool` (``env.num_workers >= 1``): each
  episode pinned to one Ray actor, its state kept there.

Both run every ``reset`` / ``step`` through :class:`EpisodeStates` (each call in a thread
under the ``env.timeout_s`` deadline), so their outcomes, error texts included, are the same
by construction: the pool does not change what a run computes.  An outcome's value is the
environment's raw return; the runner checks it (``check_step_result``) on the driver.

Nothing here imports torch, jax or ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from core.environments.multi_turn import MultiTurnEnvironment

__all__ = ["EpisodeExecutor", "EpisodeStates", "InProcessEpisodes", "Outcome", "guarded_call"]


@dataclass
class Outcome:
    """One episode's ``reset`` or ``step``: its return value, or why there is none."""

    value: Any = None
    """step: what ``env.step`` returned (unchecked); reset: None (the state stays where it was made)."""
    error: str | None = None
    """e.g. ``step() raised ValueError: ...`` or ``step() ran past env.timeout_s=5 s``; the
    runner prefixes the environment, episode and turn."""
    timed_out: bool = False
    cause: BaseException | None = None
    """The exception itself, in-process only (chained into the EpisodeError; never sent over Ray)."""


@runtime_checkable
class EpisodeExecutor(Protocol):
    """Runs the episodes of one rollout: states are keyed by the episode's row (unique within a
    rollout) and dropped by :meth:`end_rollout`."""

    name: str

    def reset_episodes(self, rows: Sequence[int], metadata: Sequence[dict[str, Any]]) -> list[Outcome]:
        """A fresh state for each row (``env.reset(metadata[i])``)."""
        ...

    def step_episodes(self, rows: Sequence[int], messages: Sequence[str]) -> list[Outcome]:
        """``env.step(state, messages[i])`` for each row's state."""
        ...

    def end_rollout(self) -> None:
        """Drop every state (the rollout is over, or failed)."""
        ...

    def shutdown(self) -> None:
        """Free what the executor holds (idempotent)."""
        ...


class _Deadline(Exception):
    pass


def guarded_call(call: Callable[[], Any], timeout_s: float, what: str, thread_name: str = "episode-step") -> Outcome:
    """``call()`` in a daemon thread under ``timeout_s``: its value, or the error.  A call over
    the deadline keeps running in the background (a thread cannot be killed).  Also the
    tools' time limit (:func:`core.environments.tools.base.run_tool`)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # reported to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return Outcome(error=f"{what}() ran past env.timeout_s={timeout_s:g} s", timed_out=True)
    if "error" in box:
        err = box["error"]
        return Outcome(error=f"{what}() raised {type(err).__name__}: {err}", cause=err)
    return Outcome(value=box["value"])


class EpisodeStates:
    """The states of the episodes one process holds, and the guarded calls on them."""

    def __init__(self, env: MultiTurnEnvironment, timeout_s: float) -> None:
        self.env, self.timeout_s = env, timeout_s
        self.states: dict[int, Any] = {}
        self.timed_out = False
        """A call ran past its deadline: its thread may still be running here."""

    def reset(self, rows: Sequence[int], metadata: Sequence[dict[str, Any]]) -> list[Outcome]:
        return [self._reset_one(row, meta) for row, meta in zip(rows, metadata, strict=True)]

    def step(self, rows: Sequence[int], messages: Sequence[str]) -> list[Outcome]:
        return [self._step_one(row, message) for row, message in zip(rows, messages, strict=True)]

    def clear(self) -> None:
        self.states.clear()

    def _reset_one(self, row: int, meta: dict[str, Any]) -> Outcome:
        outcome = self._guarded(lambda: self.env.reset(meta), "reset")
        if outcome.error is None:
            self.states[row] = outcome.value
            outcome.value = None
        return outcome

    def _step_one(self, row: int, message: str) -> Outcome:
        if row not in self.states:  # a caller bug (an ended or foreign episode), never an env's fault
            raise KeyError(f"episode {row} has no state here")
        state = self.states[row]
        return self._guarded(lambda: self.env.step(state, message), "step")

    def _guarded(self, call: Callable[[], Any], what: str) -> Outcome:
        outcome = guarded_call(call, self.timeout_s, what)
        self.timed_out = self.timed_out or outcome.timed_out
        return outcome


class InProcessEpisodes:
    """``env.num_workers: 0``: the episodes stepped on the calling thread's process, one at a time."""

    def __init__(self, env: MultiTurnEnvironment, timeout_s: float) -> None:
        self.name = env.name
        self._states = EpisodeStates(env, timeout_s)

    def reset_episodes(self, rows: Sequence[int], metadata: Sequence[dict[str, Any]]) -> list[Outcome]:
        return self._states.reset(rows, metadata)

    def step_episodes(self, rows: Sequence[int], messages: Sequence[str]) -> list[Outcome]:
        return self._states.step(rows, messages)

    def end_rollout(self) -> None:
        self._states.clear()

    def shutdown(self) -> None:
        """Nothing to free (the same call as the pool's)."""
