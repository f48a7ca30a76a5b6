"""Deadlines, health probes and death certificates for vLLM engine actors.

An engine that raised may be fine (a refused refit bucket) or wedged: vLLM's in-process
engine core can be left mid-step by an exception, after which every request -- even the
next ``is_alive`` queued behind it -- blocks forever.  So every driver call to an engine has
a deadline, and an engine call that fails is followed by a probe (a one-token generate with
its own short deadline):

* the call failed in our own checks, before the engine was touched
  (:func:`~core.distributed.recoverable.before_collectives`), or was a ``RefitError``
  (a refused manifest or bucket, stale weights: the receiver keeps the model whole and says
  so): the error is re-raised, no probe;
* the probe answers: the engine is healthy, the original error is re-raised;
* the probe fails or times out, the call timed out, or the actor died: the engine is killed
  and recorded dead; this call and every later one raise :class:`EngineDeadError`, which
  says how to recover (a new ``VllmGeneration``, refit from the live policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from core.distributed.recoverable import raised_before_collectives
from core.refit.manifest import RefitError

#: Seconds a health probe (one token of one prompt) may take before the engine is declared dead.
PROBE_TIMEOUT_S = 60.0

RECOVERY = (
    "create a new VllmGeneration and refit it from the policy "
    "(core.refit.refit_policy_generation); the policy is not affected"
)


class EngineDeadError(RuntimeError):
    """A vLLM engine died, hung or failed its health probe; it has been killed.

    Attributes: ``engine`` its index, ``what`` the call that found it dead."""

    def __init__(self, message: str, engine: int = -1, what: str = "?") -> None:
        super().__init__(message)
        self.engine = engine
        self.what = what

    def __reduce__(self):
        return (type(self), (str(self), self.engine, self.what))


class EngineHealth:
    """The engines' actor handles plus which of them are dead and why."""

    def __init__(self, engines: Sequence[ray.actor.ActorHandle], probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.engines = list(engines)
        self.probe_timeout_s = probe_timeout_s
        self.dead: dict[int, str] = {}

    def require_alive(self, what: str) -> None:
        """Refuse a call on a set of engines with a dead member, before anything is sent."""
        if self.dead:
            i, reason = next(iter(sorted(self.dead.items())))
            raise EngineDeadError(
                f"vLLM generation engine {i} is dead ({reason}); cannot {what}: {RECOVERY}", engine=i, what=what
            )

    def get(self, refs: Sequence[ray.ObjectRef], owners: Sequence[int], what: str, timeout_s: float) -> list[Any]:
        """Results of ``refs`` (``owners[k]`` = engine index of ``refs[k]``) within ``timeout_s``."""
        try:
            return ray.get(list(refs), timeout=timeout_s)
        except GetTimeoutError as exc:
            late = [owners[k] for k, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
            for i in late:
                self.declare_dead(i, f"did not answer {what} within {timeout_s:.0f} s")
            raise self._dead_error(late[0] if late else owners[0], what) from exc
        except RayError as exc:
            i = self._failed_owner(refs, owners)
            self.after_failure(i, exc, what)
            raise

    def after_failure(self, i: int, exc: BaseException, what: str) -> None:
        """Classify engine ``i``'s failure of ``what``: returns if the engine is healthy (the
        caller re-raises ``exc``), raises :class:`EngineDeadError` if it is not."""
        if isinstance(exc, RayActorError):
            self.declare_dead(i, f"its actor died during {what}: {str(exc).splitlines()[0]}")
            raise self._dead_error(i, what) from exc
        if raised_before_collectives(exc) or isinstance(exc, RefitError):
            return  # refused by our own checks (input, manifest, stale weights): nothing to probe
        problem = self.probe(i)
        if problem is not None:
            self.declare_dead(i, f"{what} raised {_first_line(exc)} and the health probe then {problem}")
            raise self._dead_error(i, what) from exc

    def probe(self, i: int) -> str | None:
        """None if engine ``i`` generates one token within the deadline, else what went wrong."""
        try:
            ray.get(self.engines[i].probe.remote(), timeout=self.probe_timeout_s)
        except GetTimeoutError:
            return f"did not answer within {self.probe_timeout_s:.0f} s"
        except RayError as exc:
            return f"failed: {_first_line(exc)}"
        return None

    def declare_dead(self, i: int, reason: str) -> None:
        self.dead.setdefault(i, reason)
        try:  # a wedged actor would hold its resources (and block its queue) for ever
            ray.kill(self.engines[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _dead_error(self, i: int, what: str) -> EngineDeadError:
        return EngineDeadError(
            f"vLLM generation engine {i} is dead ({self.dead[i]}); it was killed. To go on: {RECOVERY}",
            engine=i,
            what=what,
        )

    @staticmethod
    def _failed_owner(refs: Sequence[ray.ObjectRef], owners: Sequence[int]) -> int:
        for ref, owner in zip(refs, owners, strict=True):
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref, timeout=0)
                except RayError:
                    return owner
        return owners[0]


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"
