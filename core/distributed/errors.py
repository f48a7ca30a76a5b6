"""The errors a :class:`~core.distributed.worker_group.RayWorkerGroup` call raises.

* :class:`WorkerGroupError` -- a call failed (the method raised, an actor died) or timed out;
  the group's actors were killed unless the error says otherwise;
* :class:`RecoverableCallError` -- it failed on some ranks before any collective and every
  other rank finished: the group lives on (:mod:`core.distributed.recoverable`);
* :class:`WorkerStartupError` -- a worker died in its constructor; ``failures`` holds what
  :mod:`core.distributed.startup_failure` read off Ray's error for each such rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.distributed.startup_failure import StartupFailure

__all__ = ["WorkerGroupError", "RecoverableCallError", "WorkerStartupError"]


class WorkerGroupError(RuntimeError):
    """A call on a worker group failed or timed out.

    Attributes:
        method: the worker method that was called (``"?"`` if unknown).
        ranks: the ranks that failed (or, for a timeout, did not finish), sorted.
        errors: ``{rank: underlying exception}`` for failures; empty for a timeout.
    """

    #: True only for :class:`RecoverableCallError`: the group survived the failure.
    recoverable = False

    def __init__(
        self,
        message: str,
        method: str = "?",
        ranks: Sequence[int] = (),
        errors: Mapping[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.method = method
        self.ranks = sorted(ranks)
        self.errors = dict(errors or {})


class RecoverableCallError(WorkerGroupError):
    """A call failed on some ranks with a :class:`~core.distributed.recoverable.RecoverableWorkerError`
    (e.g. raised before any collective) and every other rank finished: the group's actors
    are alive and usable.  ``errors`` holds each failed rank's exception."""

    recoverable = True


class WorkerStartupError(WorkerGroupError):
    """A worker died in its constructor (bad optimizer, unreadable weights, a mesh that does
    not fit, ...).  The message's first line names the rank, the exception the constructor
    raised (type and first line of its message) and where (``file:line``, the innermost
    frame of project code); the remote traceback follows.

    Attributes (besides :class:`WorkerGroupError`'s): ``failures``, ``{rank: StartupFailure}``
    for the ranks whose constructor raised.
    """

    def __init__(
        self, message: str, *args: Any, failures: Mapping[int, StartupFailure] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, *args, **kwargs)
        self.failures = dict(failures or {})
