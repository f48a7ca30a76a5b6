"""A multi-turn environment's episodes in ``env.num_workers`` Ray actors (``env.num_workers >= 1``).

Each episode is pinned to the actor that reset it (contiguous chunks of the rollout's
episodes, as :class:`~core.environments.EnvironmentPool` chunks samples); its state never
leaves that actor.  Each turn the driver sends every live episode's assistant message to
its actor in ONE call per actor; the actor steps them one at a time through
:class:`~core.environments.episodes.EpisodeStates` -- the code the in-process executor
runs -- so each step has the ``env.timeout_s`` deadline and the same outcome, error text
included, as in-process.  Failures:

* a step raises, returns NaN, the wrong type, ...: that episode's outcome (the runner fails
  the step or ends the episode, ``env.on_episode_error``);
* a step overruns ``env.timeout_s``: that episode's outcome says so, and the actor steps
  its other episodes on; its thread may still run, so the actor is killed and replaced
  when the rollout ends (its other episodes finish first, with the results an in-process
  run gives them);
* a whole actor stops answering (a step blocking the process, e.g. holding the GIL in C
  code) for ``env.timeout_s`` x its episodes in the call + :data:`CALL_GRACE_S`, or dies:
  it is killed and replaced at once, and every episode it held -- exactly the episodes of
  that call, since every live episode is stepped every turn -- gets an outcome naming the
  actor and saying its state is lost (so each fails the step, or ends with its reward so far
  and is counted in ``multi_turn/episode_errors``).

``ray`` is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.environments.config import EnvConfig
from core.environments.episodes import EpisodeExecutor, EpisodeStates, InProcessEpisodes, Outcome
from core.environments.pool import ActorPool, EnvironmentPoolError, describe_exception, describe_ray_error, split_rows
from core.environments.registry import make_multi_turn_environment

__all__ = ["CALL_GRACE_S", "EpisodePool", "EpisodeWorker", "episode_executor"]

#: Seconds a call may take beyond its steps' deadlines (Ray's round trip on a loaded machine)
#: before the driver decides the actor itself is stuck.
CALL_GRACE_S = 10.0


def episode_executor(env_cfg: EnvConfig | Mapping[str, Any]) -> EpisodeExecutor:
    """Where a run's episodes live: ``env.num_workers`` actors, or (0) the driver itself.
    Either has ``shutdown()``; the pool needs Ray initialised."""
    cfg = EnvConfig.coerce(env_cfg, "env")
    if cfg.num_workers == 0:
        return InProcessEpisodes(make_multi_turn_environment(cfg), cfg.timeout_s)
    return EpisodePool(cfg)


class EpisodeWorker:
    """The body of one actor: the environment and the states of the episodes pinned here.

    ``reset`` / ``step`` return ``(outcomes, timed_out)``; they raise only on a caller bug.
    """

    def __init__(self, env_cfg: EnvConfig) -> None:
        self._episodes: EpisodeStates | None = None
        self._startup_error: str | None = None
        try:
            cfg = EnvConfig.coerce(env_cfg, "env")
            self._episodes = EpisodeStates(make_multi_turn_environment(cfg), cfg.timeout_s)
        except Exception as err:  # reported by startup_error(), where the driver waits
            self._startup_error = describe_exception(err)

    def startup_error(self) -> str | None:
        return self._startup_error

    def env_name(self) -> str:
        """The environment's own ``name`` (what the in-process executor reports)."""
        return self._states().env.name

    def reset(self, rows: list[int], metadata: list[dict[str, Any]]) -> tuple[list[Outcome], bool]:
        return self._sendable(self._states().reset(rows, metadata))

    def step(self, rows: list[int], messages: list[str]) -> tuple[list[Outcome], bool]:
        return self._sendable(self._states().step(rows, messages))

    def clear(self) -> None:
        self._states().clear()

    def _states(self) -> EpisodeStates:
        if self._episodes is None:  # the pool never calls a worker whose start-up failed
            raise RuntimeError(f"the worker has no environment: {self._startup_error}")
        return self._episodes

    def _sendable(self, outcomes: list[Outcome]) -> tuple[list[Outcome], bool]:
        for outcome in outcomes:
            outcome.cause = None  # a user's exception object need not unpickle on the driver
        return outcomes, self._states().timed_out


class EpisodePool(ActorPool):
    """The :class:`~core.environments.episodes.EpisodeExecutor` over Ray actors (module docstring)."""

    worker_body = EpisodeWorker
    #: :data:`CALL_GRACE_S`, per pool (a test shortens it).
    call_grace_s = CALL_GRACE_S

    def __init__(self, env_cfg: EnvConfig | Mapping[str, Any]) -> None:
        cfg = EnvConfig.coerce(env_cfg, "env")
        if cfg.num_workers < 1:  # the caller builds InProcessEpisodes for 0
            raise ValueError("env.num_workers: 0 steps episodes in-process (InProcessEpisodes), not in a pool")
        super().__init__(cfg)
        import ray

        try:  # errors name the environment as in-process ones do: by its `name`, not env.name's import path
            self.name = str(ray.get(self._actors[0].env_name.remote(), timeout=self.call_grace_s))
        except BaseException:
            self.shutdown()
            raise
        self._home: dict[int, int] = {}
        """Episode row -> the worker holding its state (this rollout)."""
        self._tainted: set[int] = set()
        """Workers where a step overran its deadline: replaced when the rollout ends."""

    def reset_episodes(self, rows: Sequence[int], metadata: Sequence[dict[str, Any]]) -> list[Outcome]:
        self._check_usable()
        for worker, (a, b) in enumerate(split_rows(len(rows), self.num_workers) if rows else []):
            self._home.update((row, worker) for row in rows[a:b])
        return self._call("reset", rows, list(metadata))

    def step_episodes(self, rows: Sequence[int], messages: Sequence[str]) -> list[Outcome]:
        self._check_usable()
        return self._call("step", rows, list(messages))

    def end_rollout(self) -> None:
        """Drop the states; replace the workers where a step overran (their threads may run on).
        A failed replacement marks the pool unusable (the next call says why) instead of
        hiding the error that ended the rollout."""
        import ray

        tainted, self._tainted, self._home = sorted(self._tainted), set(), {}
        if self._broken is not None:
            return
        try:
            if tainted:
                self._replace_workers(tainted)
            ray.get([actor.clear.remote() for actor in self._actors], timeout=self.call_grace_s)
        except EnvironmentPoolError:
            pass  # _replace_workers recorded it in self._broken
        except Exception as err:  # a worker that cannot even clear: the pool is not to be trusted
            self._broken = f"clearing the episode states failed: {describe_ray_error(err)}"
            self.shutdown()

    # ------------------------------------------------------------------ internals
    def _call(self, what: str, rows: Sequence[int], args: list[Any]) -> list[Outcome]:
        """``worker.<what>(its rows, their args)`` on every worker holding one of ``rows``, at
        once; the outcomes in ``rows``' order."""
        import ray

        if not rows:
            return []
        by_worker: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_worker.setdefault(self._home[row], []).append(i)
        refs = {
            worker: getattr(self._actors[worker], what).remote([rows[i] for i in idx], [args[i] for i in idx])
            for worker, idx in by_worker.items()
        }
        deadline = self.timeout_s * max((len(idx) for idx in by_worker.values()), default=0) + self.call_grace_s
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=deadline)
        outcomes: list[Outcome] = [Outcome()] * len(rows)
        for worker, idx in by_worker.items():
            if refs[worker] in pending:
                got = self._lose(worker, len(idx), f"did not answer within {deadline:g} s (a step blocked it)")
            else:
                got = self._fetch(worker, refs[worker], len(idx))
            for i, outcome in zip(idx, got, strict=True):
                outcomes[i] = outcome
        return outcomes

    def _fetch(self, worker: int, ref: Any, count: int) -> list[Outcome]:
        import ray
        from ray.exceptions import RayActorError, RayError

        try:
            outcomes, timed_out = ray.get(ref)
        except RayActorError as err:
            return self._lose(worker, count, f"died: {describe_ray_error(err)}")
        except RayError as err:  # e.g. a step's return value could not be sent back
            error = f"worker {worker}'s results could not be received: {describe_ray_error(err)}"
            return [Outcome(error=error) for _ in range(count)]
        if timed_out:
            self._tainted.add(worker)
        return list(outcomes)

    def _lose(self, worker: int, count: int, what: str) -> list[Outcome]:
        """Kill and replace ``worker``; its ``count`` episodes of this call get an outcome saying
        their state is lost."""
        self._tainted.discard(worker)
        self._replace_workers([worker])
        error = (
            f"worker {worker} of the episode pool {what}; it was killed and replaced, and the state "
            "of this episode is lost"
        )
        return [Outcome(error=error, timed_out=True) for _ in range(count)]
