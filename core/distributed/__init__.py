"""Ray plumbing shared by every backend: start Ray, reserve resources, run SPMD worker groups.

* :func:`init_ray` -- start or join Ray once, quietly (no dashboard, small object store).
* :class:`RayVirtualCluster` -- one ``STRICT_PACK`` placement group per node.
* :class:`RayWorkerGroup` -- one actor per bundle with ``RANK``/``MASTER_ADDR``/... set;
  single-data and sharded calls; fail-fast result collection (:class:`WorkerGroupError`;
  :class:`WorkerStartupError` when a worker's constructor raised; :class:`RecoverableCallError`
  when every failure was recoverable and the group lives on, see :mod:`core.distributed.recoverable`;
  :class:`StartupFailure`, read by :mod:`core.distributed.startup_failure`, names a constructor's error).
* :class:`WorkerLayout` -- rank <-> coordinates on named axes (``dp``/``cp``/``tp``).
"""

from core.distributed.errors import RecoverableCallError, WorkerGroupError, WorkerStartupError
from core.distributed.layout import WorkerLayout
from core.distributed.ray_init import init_ray
from core.distributed.recoverable import (
    RecoverableWorkerError,
    RefitPeerLostError,
    before_collectives,
    raised_before_collectives,
)
from core.distributed.startup_failure import StartupFailure
from core.distributed.virtual_cluster import RayVirtualCluster, ResourcesUnavailableError
from core.distributed.worker_group import RayWorkerGroup, ShardedFuture

__all__ = [
    "init_ray",
    "RayVirtualCluster",
    "ResourcesUnavailableError",
    "RayWorkerGroup",
    "ShardedFuture",
    "WorkerGroupError",
    "RecoverableCallError",
    "RecoverableWorkerError",
    "RefitPeerLostError",
    "before_collectives",
    "raised_before_collectives",
    "WorkerLayout",
    "WorkerStartupError",
    "StartupFailure",
]
