"""Where a :class:`~core.distributed.worker_group.RayWorkerGroup` puts its actors, and what
each one is told about its rank.

One actor per used bundle of a :class:`~core.distributed.virtual_cluster.RayVirtualCluster`
(or ``per_bundle`` of them, sharing its resources), node by node, rank = bundle order, each
pinned to its bundle and started with the ``torch.distributed`` ``env://`` variables of its rank.

On a CPU cluster each actor computes with its share of its bundle's CPUs (``OMP_NUM_THREADS``,
:func:`cpu_threads`): the bundle divided among the actors placed in it, not among the worker
groups colocated on it.  Ray would give an actor ``floor(its num_cpus)`` threads, and its
``num_cpus`` is also divided among the colocated groups (the policy and its vLLM engines): that
would halve both, although each waits while the other runs.  A user's ``OMP_NUM_THREADS`` wins.

A CPU actor also starts with glibc's malloc set to keep the memory it frees, in transparent
huge pages (:data:`CPU_MALLOC_TUNABLES`): XLA:CPU allocates each program's temporary buffer
afresh on every execution (GB for a training step), and glibc mapped it afresh each time, so
every execution faulted it in again.  A user's ``GLIBC_TUNABLES`` wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from core.distributed.virtual_cluster import RayVirtualCluster

__all__ = [
    "CPU_MALLOC_TUNABLES",
    "RESERVED_ENV_VARS",
    "check_env_vars",
    "check_workers_per_node",
    "cpu_threads",
    "create_actors",
    "kill_actors",
]

#: Env vars the group sets on every worker; ``env_vars`` may not override them.
RESERVED_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: ``GLIBC_TUNABLES`` of a CPU actor: malloc keeps the memory it frees for the next allocation,
#: in transparent huge pages.  By default glibc serves every allocation above 32 MiB with a fresh
#: mapping and unmaps it on free; XLA:CPU allocates a training step's temporary buffer (GB per
#: device on the bench's small model) afresh on every execution, so each execution faulted it in
#: again, page by page (on a VM that hands freed guest memory back to its host, likely a host
#: fault too; docs/results.md, "CPU actors keep the memory malloc frees").  Hence:
#:
#: * ``arena_max=1`` and ``mmap_max=0``: every thread allocates from the one heap that grows
#:   with ``brk`` (a thread arena's heap is capped at 64 MiB and would map large blocks anyway);
#: * ``trim_threshold``: that heap is never shrunk, so a process keeps its high-water mark of
#:   malloc'd memory and reuses it: no faults once a program has run;
#: * ``hugetlb=1``: what the heap grows by is advised as transparent huge pages (512x fewer faults).
#:
#: Ignored by a glibc older than 2.26 (``hugetlb``: 2.35, or a kernel whose THP mode is
#: ``never``); no computed value depends on it.
CPU_MALLOC_TUNABLES = ":".join(
    (
        "glibc.malloc.arena_max=1",
        "glibc.malloc.mmap_max=0",
        f"glibc.malloc.trim_threshold={1 << 40}",
        "glibc.malloc.hugetlb=1",
    )
)


def check_env_vars(env_vars: Mapping[str, str] | None) -> dict[str, str]:
    """The extra env vars for every worker, as a dict; they may not set a rank variable."""
    env_vars = dict(env_vars or {})
    clash = sorted(set(env_vars) & set(RESERVED_ENV_VARS))
    if clash:
        raise ValueError(f"RayWorkerGroup: env_vars may not set {clash}; the group sets them per rank")
    return env_vars


def check_workers_per_node(bundles: list[int], requested: int | list[int] | None, per_bundle: int = 1) -> list[int]:
    """Workers on each node: validated against the node's bundle count (x ``per_bundle``)."""
    if isinstance(per_bundle, bool) or not isinstance(per_bundle, int) or per_bundle < 1:
        raise ValueError(f"RayWorkerGroup: actors_per_bundle must be a positive int, got {per_bundle!r}")
    bundles = [n * per_bundle for n in bundles]
    if requested is None:
        return list(bundles)
    if isinstance(requested, int) and not isinstance(requested, bool):
        counts = [requested] * len(bundles)
    elif isinstance(requested, Sequence) and not isinstance(requested, str):
        counts = list(requested)
        if len(counts) != len(bundles):
            raise ValueError(
                f"RayWorkerGroup: workers_per_node has {len(counts)} entries but the cluster has "
                f"{len(bundles)} nodes ({bundles} bundles per node)"
            )
    else:
        raise TypeError(f"RayWorkerGroup: workers_per_node must be None, an int or a list, got {requested!r}")
    for node, (want, have) in enumerate(zip(counts, bundles, strict=True)):
        if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= have:
            raise ValueError(
                f"RayWorkerGroup: node {node} has {have // per_bundle} bundles x {per_bundle} worker(s) each; "
                f"cannot place {want!r} workers there"
            )
    if sum(counts) == 0:
        raise ValueError("RayWorkerGroup: workers_per_node places no worker at all")
    return counts


def cpu_threads(cluster: RayVirtualCluster, per_bundle: int = 1) -> int:
    """Compute threads of each of ``per_bundle`` actors sharing one bundle of a CPU cluster."""
    return max(1, int(cluster.num_cpus_per_bundle) // per_bundle)


def create_actors(
    cluster: RayVirtualCluster,
    worker_cls: type,
    args: tuple,
    kwargs: Mapping[str, Any],
    env_vars: Mapping[str, str],
    counts: list[int],
    name_prefix: str,
    per_bundle: int = 1,
) -> tuple[list[ray.actor.ActorHandle], list[tuple[int, int]]]:
    """``counts[n]`` actors on node ``n``, node by node, ``per_bundle`` of them per bundle
    (consecutive ranks, each with that share of the bundle's resources), each pinned to its
    bundle; returns the actors (index = rank) and each rank's (node rank, bundle index).

    If an actor cannot be created, the ones created before it are killed and the error
    is raised."""
    actor_cls: ray.actor.ActorClass
    if isinstance(worker_cls, ray.actor.ActorClass):
        actor_cls = worker_cls
    else:
        actor_cls = ray.remote(worker_cls)
    master_addr, master_port = cluster.get_master_address_and_port()
    share = 1.0 / (cluster.max_colocated_worker_groups * per_bundle)
    resources: dict[str, float] = {"num_cpus": cluster.num_cpus_per_bundle * share}
    if cluster.use_gpus:
        resources["num_gpus"] = share
    placement_groups = cluster.get_placement_groups()
    world_size = sum(counts)
    workers: list[ray.actor.ActorHandle] = []
    placement: list[tuple[int, int]] = []
    rank = 0
    for node_rank, (pg, count) in enumerate(zip(placement_groups, counts, strict=True)):
        for local_rank in range(count):
            env = dict(env_vars)
            if not cluster.use_gpus:
                env.setdefault("CUDA_VISIBLE_DEVICES", "")
                threads = os.environ.get("OMP_NUM_THREADS", str(cpu_threads(cluster, per_bundle)))
                env.setdefault("OMP_NUM_THREADS", threads)
                env.setdefault("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES", CPU_MALLOC_TUNABLES))
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(count),
                NODE_RANK=str(node_rank),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )
            options = dict(
                name=f"{name_prefix}-{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=local_rank // per_bundle,
                    # tasks/actors a worker spawns stay inside the cluster's resources
                    placement_group_capture_child_tasks=True,
                ),
                runtime_env={"env_vars": env},
                # a restarted rank would not rejoin its process group: fail instead
                max_restarts=0,
                **resources,
            )
            try:
                # ray types .remote() as ActorHandle | type[T] (its ActorProxy, so that methods
                # type-check through @ray.method); at run time it is the handle.
                workers.append(actor_cls.options(**options).remote(*args, **kwargs))  # type: ignore[arg-type]
            except Exception:
                kill_actors(workers)
                raise
            placement.append((node_rank, local_rank // per_bundle))
            rank += 1
    return workers, placement


def kill_actors(workers: Sequence[ray.actor.ActorHandle]) -> None:
    """``ray.kill`` every actor (no restart); an actor that is already dead is skipped."""
    for worker in workers:
        try:
            ray.kill(worker, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead / Ray gone: nothing left to kill
            pass
