"""Typed calls from the driver to a group of :class:`PolicyWorker`\\ s.

A call names the protocol's method object, not a string::

    workers.all(PolicyWorker.save_hf_checkpoint, path, False)        # -> list[None]
    workers.sharded(PolicyWorker.get_logprobs, shards, micro_batch_size=4)

The method's parameters after ``self`` (and, for ``sharded``, after the data shard) are the
call's, so the type checker checks the arguments against the protocol and types the result
(``list[R]``); a method that is not the protocol's is refused when called.  The group
underneath (:class:`core.distributed.RayWorkerGroup`) stays generic: it serves vLLM's workers
too, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from core.policy.worker_protocol import PolicyWorker

if TYPE_CHECKING:
    import ray

    from core.data import BatchedDataDict
    from core.distributed import RayWorkerGroup

P = ParamSpec("P")
R = TypeVar("R")


def protocol_method_name(method: Callable[..., Any]) -> str:
    """The name of one of :class:`PolicyWorker`'s methods; TypeError for anything else."""
    name = getattr(method, "__name__", None)
    if name is None or name.startswith("_") or PolicyWorker.__dict__.get(name) is not method:
        raise TypeError(f"{method!r} is not a method of core.policy.worker_protocol.PolicyWorker")
    return name


class WorkerCalls:
    """The driver's calls on ``group``: every worker, or one data shard per data-parallel rank."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def futures(
        self, method: Callable[Concatenate[PolicyWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[ray.ObjectRef]:
        """Start ``method(*args, **kwargs)`` on every worker; one future per rank (for calls
        the caller waits on together with another group's, e.g. a refit's two sides)."""
        return self.group.run_all_workers_single_data(protocol_method_name(method), *args, **kwargs)

    def all(self, method: Callable[Concatenate[PolicyWorker, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method(*args, **kwargs)`` on every worker; the results in rank order."""
        return self.group.get_all_worker_results(self.futures(method, *args, **kwargs))

    def sharded(
        self,
        method: Callable[Concatenate[PolicyWorker, BatchedDataDict, P], R],
        shards: Sequence[BatchedDataDict],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[R]:
        """``method(shards[i], **kwargs)`` on every rank of data-parallel coordinate ``i``
        (the shard replicated over ``cp`` / ``tp``); one result per shard, in shard order."""
        if args:
            raise TypeError(f"{protocol_method_name(method)}: a sharded call passes its other arguments by keyword")
        group = self.group
        future = group.run_all_workers_sharded_data(
            protocol_method_name(method),
            list(shards),
            in_sharded_axes=("dp",),
            replicate_on_axes=("cp", "tp"),
            output_is_replicated=("cp", "tp"),
            common_kwargs=kwargs,
        )
        return group.get_all_worker_results(future)
