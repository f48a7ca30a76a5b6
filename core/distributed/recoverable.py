"""Which worker failures a group survives.

A rank that raises while its peers are inside a collective leaves them blocked for good, so
by default any failure kills the whole :class:`~core.distributed.RayWorkerGroup`.  Some
failures are known to leave every rank consistent and free:

* an exception raised by a worker method before its first collective (input validation,
  path checks, I/O set-up) inside :func:`before_collectives`, which *marks* it (the
  exception keeps its own type -- a ``CheckpointError`` stays one -- and the mark travels
  through Ray's pickling with it);
* :class:`RefitPeerLostError` -- the generation engine died during a ``collective`` refit;
  the sending rank stopped broadcasting but still took part in every gather its training
  peers ran, so the training group is intact.  Any :class:`RecoverableWorkerError` counts.

The group keeps its actors when *every* failed rank raised a recoverable exception and every
other rank finished the call; otherwise (a dead process, any other exception, or a peer
still running -- blocked in a collective waiting for the failed rank) it kills them.  The
error the driver sees says which of the two happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "RecoverableWorkerError",
    "RefitPeerLostError",
    "before_collectives",
    "raised_before_collectives",
    "recoverable_cause",
]

#: Attribute :func:`before_collectives` sets on the exceptions it lets through.
_MARK = "dualrl_before_collectives"


class RecoverableWorkerError(RuntimeError):
    """A worker-side failure after which the worker (and its group) is still consistent.

    Attributes: ``original_type`` the class name of the exception behind it (``""`` if none),
    ``message`` its message.  Only strings, so it pickles across Ray whatever the cause was.
    """

    def __init__(self, message: str, original_type: str = "") -> None:
        super().__init__(f"{original_type}: {message}" if original_type else message)
        self.original_type = original_type
        self.message = message

    def __reduce__(self):  # keep both fields through Ray's pickling
        return (type(self), (self.message, self.original_type))


class RefitPeerLostError(RecoverableWorkerError):
    """The generation engine left a ``collective`` refit; the training ranks are intact."""


@contextlib.contextmanager
def before_collectives() -> Iterator[None]:
    """Wrap the part of a worker method that runs before its first collective: any
    ``Exception`` raised inside is re-raised as itself, marked so that the group may keep
    its actors (:func:`raised_before_collectives`)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised unchanged, only marked
        setattr(exc, _MARK, True)
        raise


def raised_before_collectives(err: BaseException) -> bool:
    """Whether ``err`` (or the worker exception a Ray task error carries) was raised inside
    :func:`before_collectives`."""
    cause = _cause(err)
    return cause is not None and bool(getattr(cause, _MARK, False))


def recoverable_cause(err: BaseException) -> BaseException | None:
    """The worker exception behind ``err`` if it is recoverable (marked by
    :func:`before_collectives`, or a :class:`RecoverableWorkerError`), else None -- also for
    a dead actor, which is never recoverable."""
    cause = _cause(err)
    if cause is None:
        return None
    return cause if isinstance(cause, RecoverableWorkerError) or getattr(cause, _MARK, False) else None


def _cause(err: BaseException) -> BaseException | None:
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(err, RayActorError):
        return None
    if isinstance(err, RayTaskError):
        return getattr(err, "cause", None)
    return err
