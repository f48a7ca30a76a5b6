"""Rewards off the driver: an environment replicated over Ray actors, scored in chunks.

A reward function may be slow (a verifier, a sandboxed test run) or crash; running it in
``num_workers`` actors keeps it off the driver and spreads a batch over them.  The actors
ask Ray for ``num_cpus=0`` so that they never take a slot from the placement groups of the
policy or generation workers.

Failures, and what the caller sees:

* a bad environment config: :class:`EnvironmentPoolError` from the constructor, carrying
  the original exception's type and message (e.g. ``ValueError: env.arithmetic.max_value``);
* the reward function raises: :class:`~core.environments.RewardError` naming the sample
  (the worker re-scores its chunk one sample at a time to find it), the exception type
  and message, and the remote traceback; the pool stays usable;
* a malformed result (count, NaN, ...): RewardError from
  :func:`~core.environments.check_environment_return`, with the global sample index;
* a chunk slower than ``env.timeout_s``: RewardError naming the chunk; its worker is
  killed and replaced, so the pool stays usable;
* a worker process dies: EnvironmentPoolError; the pool is unusable from then on.

``ray`` is imported lazily, so importing :mod:`core.environments` stays light.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from core.environments.config import EnvConfig
from core.environments.interfaces import (
    EnvironmentReturn,
    RewardError,
    check_batch_lengths,
    check_environment_return,
    describe_sample,
)
from core.environments.registry import make_environment, resolve_environment_class

__all__ = ["ActorPool", "EnvironmentPool", "EnvironmentPoolError", "EnvironmentWorker"]

#: Seconds the workers get to import and build their environment (imports are slow on a
#: loaded 2-core machine, and a user environment may load a model).
STARTUP_TIMEOUT_S = 300.0


class EnvironmentPoolError(RuntimeError):
    """The pool cannot score: a worker could not build its environment, or died."""


class EnvironmentWorker:
    """The body of one pool actor: builds the environment and scores chunks.

    Its methods never raise.  They return ``("ok", value)`` or ``("error", message)``, so
    that the driver writes every message itself instead of unwrapping Ray's exception
    wrappers, whose text differs between failure kinds and Ray versions.
    """

    def __init__(self, env_cfg: EnvConfig) -> None:
        self._env = None
        self._startup_error: str | None = None
        try:
            self._env = make_environment(env_cfg)
        except Exception as err:  # reported by startup_error(), where the driver waits
            self._startup_error = describe_exception(err)

    def startup_error(self) -> str | None:
        """``None`` once the environment is built, else why it could not be."""
        return self._startup_error

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        metadata: list[dict[str, Any]],
        offset: int,
    ) -> tuple[str, Any]:
        """Score one chunk whose first sample has global index ``offset``."""
        if self._env is None:
            return ("error", f"the worker has no environment: {self._startup_error}")
        try:
            return ("ok", self._env.score(prompts, completions, metadata))
        except Exception as err:
            return ("error", self._locate_failure(prompts, completions, metadata, offset, err))

    def _locate_failure(
        self,
        prompts: list[str],
        completions: list[str],
        metadata: list[dict[str, Any]],
        offset: int,
        chunk_error: Exception,
    ) -> str:
        """Re-score sample by sample to name the one that raises (chunks are small)."""
        env = self._env
        if env is None:  # score() checked it
            return f"the worker has no environment: {self._startup_error}"
        name = getattr(env, "name", "?")
        for i, (prompt, completion, meta) in enumerate(zip(prompts, completions, metadata, strict=True)):
            try:
                env.score([prompt], [completion], [meta])
            except Exception as err:
                sample = describe_sample(offset + i, prompt, completion)
                return f"environment {name!r}: {sample}: score() raised {describe_exception(err)}"
        last = offset + len(prompts) - 1
        return (
            f"environment {name!r}: samples {offset}..{last}: score() raised "
            f"{describe_exception(chunk_error)}\n(no single sample of this chunk raises on its own)"
        )


class ActorPool:
    """``env.num_workers`` Ray actors whose body is :attr:`worker_body` built from the ``env``
    section: started, awaited, replaced and killed here; what they are asked is the subclass's.

    ``env_cfg`` is the whole ``env`` section (:class:`EnvConfig` or its plain mapping).  Ray
    must be initialised (``core.distributed.init_ray``) before the pool is built.
    """

    #: The actor's class: ``worker_body(env_cfg)``, with ``startup_error() -> str | None``.
    worker_body: type = EnvironmentWorker

    def __init__(self, env_cfg: EnvConfig | Mapping[str, Any]) -> None:
        import ray

        self._env_cfg = EnvConfig.coerce(env_cfg, "env")
        self.name, self.num_workers, self.timeout_s = _pool_settings(self._env_cfg)
        if not ray.is_initialized():
            raise EnvironmentPoolError("Ray is not initialised: call core.distributed.init_ray() first")
        # ray types an actor as ActorHandle | type[T] and gives methods a .remote only through
        # @ray.method (which would import ray with this module): the actors are Any here.
        self._actor_cls: Any = ray.remote(num_cpus=0)(self.worker_body)
        self._broken: str | None = None
        self._actors: list[Any] = [self._actor_cls.remote(self._env_cfg) for _ in range(self.num_workers)]
        try:
            self._await_startup()
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Kill the workers (idempotent); the pool cannot be used afterwards."""
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray already shut down: nothing to free
                pass
        self._actors = []
        if self._broken is None:
            self._broken = "the pool was shut down"

    def __repr__(self) -> str:
        settings = f"name={self.name!r}, num_workers={self.num_workers}, timeout_s={self.timeout_s}"
        return f"{type(self).__name__}({settings})"

    # ------------------------------------------------------------------ internals
    def _await_startup(self, workers: list[int] | None = None) -> None:
        """Wait until ``workers`` (default all) have built their environment; raise with the
        first cause."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        workers = list(range(len(self._actors))) if workers is None else workers
        refs = [self._actors[worker].startup_error.remote() for worker in workers]
        for worker, ref in zip(workers, refs, strict=True):
            where = f"environment {self.name!r}: worker {worker} of {self.num_workers}"
            try:
                error = ray.get(ref, timeout=STARTUP_TIMEOUT_S)
            except GetTimeoutError:
                raise EnvironmentPoolError(
                    f"{where} did not build its environment within {STARTUP_TIMEOUT_S:.0f} s"
                ) from None
            except RayError as err:
                cause = describe_ray_error(err)
                raise EnvironmentPoolError(f"{where} died while starting: {cause}") from None
            if error is not None:
                raise EnvironmentPoolError(f"{where} could not build the environment: {error}")

    def _replace_workers(self, workers: list[int]) -> None:
        """Kill hung workers and start fresh ones in their place.  Awaited, so that the next
        batch's ``timeout_s`` does not have to cover a worker's start-up."""
        import ray

        for worker in workers:
            ray.kill(self._actors[worker], no_restart=True)
            self._actors[worker] = self._actor_cls.remote(self._env_cfg)
        try:
            self._await_startup(workers)
        except EnvironmentPoolError as err:
            self._broken = f"a replacement worker failed: {err}"
            self.shutdown()
            raise

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise EnvironmentPoolError(
                f"environment {self.name!r}: the pool is unusable ({self._broken}); build a new {type(self).__name__}"
            )


class EnvironmentPool(ActorPool):
    """``env.num_workers`` Ray actors scoring the single-turn environment ``env.name`` in chunks."""

    worker_body = EnvironmentWorker

    def __init__(self, env_cfg: EnvConfig | Mapping[str, Any]) -> None:
        cfg = EnvConfig.coerce(env_cfg, "env")
        if cfg.num_workers < 1:  # 0 is for a multi-turn environment's episodes, stepped in-process
            raise ValueError(
                f"env.num_workers: 0 runs a multi-turn environment in-process on the driver; env.name "
                f"{cfg.name!r} is scored by the Ray pool: set env.num_workers >= 1"
            )
        super().__init__(cfg)

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[dict[str, Any]],
    ) -> EnvironmentReturn:
        """Rewards and infos for every sample, in the caller's order."""
        check_batch_lengths(prompts, completions, metadata)
        self._check_usable()
        if len(prompts) == 0:
            return EnvironmentReturn(rewards=[], infos=[])
        chunks = split_rows(len(prompts), self.num_workers)
        # Fewer samples than workers: the first len(chunks) workers score them, the rest idle.
        refs = [
            actor.score.remote(list(prompts[a:b]), list(completions[a:b]), list(metadata[a:b]), a)
            for actor, (a, b) in zip(self._actors[: len(chunks)], chunks, strict=True)
        ]
        self._wait_or_time_out(refs, chunks)
        rewards: list[float] = []
        infos: list[dict[str, Any]] = []
        for worker, (ref, (a, b)) in enumerate(zip(refs, chunks, strict=True)):
            result = self._fetch(ref, worker, a, b)
            checked = check_environment_return(result, prompts[a:b], completions[a:b], self.name, offset=a)
            rewards.extend(checked.rewards)
            infos.extend(checked.infos)
        return EnvironmentReturn(rewards=rewards, infos=infos)

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _wait_or_time_out(self, refs: list[Any], chunks: list[tuple[int, int]]) -> None:
        """Return when every chunk is done; after ``timeout_s``, replace the hung workers and
        raise a RewardError naming their chunks."""
        import ray

        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if not pending:
            return
        hung = [worker for worker, ref in enumerate(refs) if ref in pending]
        self._replace_workers(hung)
        described = ", ".join(f"chunk {w} (samples {chunks[w][0]}..{chunks[w][1] - 1}) on worker {w}" for w in hung)
        raise RewardError(
            f"environment {self.name!r}: {described} did not finish within {self.timeout_s:g} s "
            f"(env.timeout_s); the worker was restarted, the batch was not scored"
        )

    def _fetch(self, ref: Any, worker: int, start: int, stop: int) -> Any:
        """One chunk's EnvironmentReturn, or the error that chunk reports."""
        import ray
        from ray.exceptions import RayActorError, RayError

        chunk = f"chunk {worker} (samples {start}..{stop - 1})"
        try:
            status, value = ray.get(ref)
        except RayActorError as err:
            self._broken = f"worker {worker} died while scoring {chunk}: {describe_ray_error(err)}"
            self.shutdown()
            raise EnvironmentPoolError(f"environment {self.name!r}: {self._broken}") from None
        except RayError as err:  # e.g. the result could not be serialised
            raise RewardError(f"environment {self.name!r}: {chunk}: {describe_ray_error(err)}") from None
        if status != "ok":
            raise RewardError(value)
        return value


# ---------------------------------------------------------------------- helpers
def _pool_settings(env_cfg: EnvConfig | Mapping[str, Any]) -> tuple[str, int, float]:
    """``(name, num_workers, timeout_s)`` from the ``env`` section, validated."""
    cfg = EnvConfig.coerce(env_cfg, "env")
    # Resolve on the driver too: an unknown name or a broken import path fails here with a
    # plain ValueError, before any actor starts.
    resolve_environment_class(cfg.name)
    return cfg.name, cfg.num_workers, cfg.timeout_s


def split_rows(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` chunks of ``n`` samples over at most ``workers`` workers,
    sizes differing by at most one."""
    count = min(n, workers)
    base, extra = divmod(n, count)
    bounds, start = [], 0
    for k in range(count):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def describe_exception(err: BaseException) -> str:
    """``ValueError: message`` followed by the traceback (indented), for remote errors."""
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
    indented = "\n".join("    " + line for line in trace.splitlines())
    return f"{type(err).__name__}: {err}\n  remote traceback:\n{indented}"


def describe_ray_error(err: BaseException) -> str:
    """The worker's own exception when Ray wrapped one, else Ray's own explanation."""
    from ray.exceptions import RayTaskError

    cause = getattr(err, "cause", None) if isinstance(err, RayTaskError) else None
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"
