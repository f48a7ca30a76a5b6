"""A fixed set of Ray resource bundles, grouped by node, that worker groups are placed on.

NeMo RL's ``RayVirtualCluster``: the caller says how many bundles each node contributes
(``[8, 8]`` = two nodes of 8 GPUs) and gets one placement group per node.  Each group is
``STRICT_PACK`` so that a node's bundles really share a machine (NVLink / shared memory /
a common ``LOCAL_RANK`` numbering); the groups are separate so that Ray is free to put
them on different machines.  Ray has no anti-affinity between placement groups, so when a
machine has room for two of them it may host both; everything downstream (the master
address, ``NODE_RANK``/``LOCAL_RANK``) is derived from the *logical* node, which stays
correct in that case.  In the usual set-up a node's bundle count equals its GPU count, so
each group fills one machine and the groups necessarily land on different machines.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["RayVirtualCluster", "ResourcesUnavailableError", "DEFAULT_PLACEMENT_GROUP_TIMEOUT_S"]

#: How long to wait for the placement groups before concluding the cluster cannot host them.
DEFAULT_PLACEMENT_GROUP_TIMEOUT_S = 60.0


class ResourcesUnavailableError(RuntimeError):
    """The placement groups a :class:`RayVirtualCluster` asked for were not granted in time."""


class RayVirtualCluster:
    """One ``STRICT_PACK`` placement group per (logical) node, created eagerly.

    Args:
        bundle_ct_per_node_list: bundles per node, e.g. ``[4, 4]``; every entry >= 1.
        use_gpus: GPU bundles (``{"GPU": 1, "CPU": n}``) or CPU bundles (``{"CPU": n}``).
            ``None``: GPU bundles iff the Ray cluster reports any GPU.
        num_cpus_per_bundle: CPUs in each bundle (``n`` above).
        max_colocated_worker_groups: how many worker groups will share each bundle (e.g.
            the policy and the generation engine); each of their actors then asks for
            ``1 / max_colocated_worker_groups`` of the bundle.
        name: prefix of the placement groups' names (for ``ray status`` / debugging).
        placement_group_timeout_s: how long to wait for the groups; on expiry they are
            removed and :class:`ResourcesUnavailableError` names what was asked and what
            the cluster has.

    Ray must be initialised (see :func:`core.distributed.init_ray`).
    """

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        use_gpus: bool | None = None,
        num_cpus_per_bundle: int = 1,
        max_colocated_worker_groups: int = 1,
        name: str = "",
        placement_group_timeout_s: float = DEFAULT_PLACEMENT_GROUP_TIMEOUT_S,
    ) -> None:
        _check_bundle_counts(bundle_ct_per_node_list)
        if not num_cpus_per_bundle > 0:
            raise ValueError(f"RayVirtualCluster: num_cpus_per_bundle must be > 0, got {num_cpus_per_bundle!r}")
        if not (isinstance(max_colocated_worker_groups, int) and max_colocated_worker_groups >= 1):
            raise ValueError(
                "RayVirtualCluster: max_colocated_worker_groups must be an integer >= 1, "
                f"got {max_colocated_worker_groups!r}"
            )
        if not ray.is_initialized():
            raise RuntimeError("RayVirtualCluster: Ray is not initialised; call core.distributed.init_ray() first")
        self._bundle_ct_per_node_list = [int(n) for n in bundle_ct_per_node_list]
        self._use_gpus = bool(use_gpus) if use_gpus is not None else _cluster_has_gpus()
        self._num_cpus_per_bundle = num_cpus_per_bundle
        self._max_colocated_worker_groups = max_colocated_worker_groups
        self._name = name
        self._placement_groups: list[PlacementGroup] = self._create_placement_groups(placement_group_timeout_s)

    # ------------------------------------------------------------------ description
    @property
    def use_gpus(self) -> bool:
        """Whether the bundles hold a GPU each."""
        return self._use_gpus

    @property
    def num_cpus_per_bundle(self) -> int:
        return self._num_cpus_per_bundle

    @property
    def max_colocated_worker_groups(self) -> int:
        return self._max_colocated_worker_groups

    @property
    def bundle_ct_per_node_list(self) -> list[int]:
        """Bundles per logical node (a copy)."""
        return list(self._bundle_ct_per_node_list)

    def bundle_resources(self) -> dict[str, float]:
        """The resources of one bundle, as passed to Ray."""
        if self._use_gpus:
            return {"GPU": 1, "CPU": self._num_cpus_per_bundle}
        return {"CPU": self._num_cpus_per_bundle}

    def world_size(self) -> int:
        """Total number of bundles over all nodes."""
        return sum(self._bundle_ct_per_node_list)

    def node_count(self) -> int:
        """Number of logical nodes (= placement groups)."""
        return len(self._bundle_ct_per_node_list)

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The placement groups, node 0 first; bundle ``i`` of group ``k`` is node ``k``'s
        ``i``-th bundle.  Raises if the cluster was shut down."""
        if not self._placement_groups:
            raise RuntimeError(f"RayVirtualCluster{self._label()}: already shut down")
        return list(self._placement_groups)

    # ------------------------------------------------------------------ rendezvous
    def get_master_address_and_port(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """``(ip, port)`` for ``torch.distributed`` / jax rendezvous: the IP of the node that
        holds bundle 0 of node 0 and a TCP port that was free there a moment ago.

        The answer comes from a tiny task *scheduled into that bundle*: the driver may run
        on another machine than rank 0, so only the bundle's node knows its own address
        and which of its ports are free.  A new port is picked on every call (each worker
        group needs its own).  The task asks for no CPU, so it runs even while the
        bundle's CPUs are held by actors.
        """
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.get_placement_groups()[0], placement_group_bundle_index=0
        )
        ref = _node_ip_and_free_port.options(num_cpus=0, scheduling_strategy=strategy).remote()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        if not ready:
            ray.cancel(ref, force=True)
            raise TimeoutError(
                f"RayVirtualCluster{self._label()}: the address/port probe in bundle 0 did not "
                f"finish within {timeout_s} s"
            )
        ip, port = ray.get(ref)
        return ip, port

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Remove the placement groups (which kills any actor still placed in them).
        Idempotent."""
        groups, self._placement_groups = self._placement_groups, []
        for pg in groups:
            _remove_quietly(pg)

    def __enter__(self) -> RayVirtualCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "GPU" if self._use_gpus else "CPU"
        return (
            f"RayVirtualCluster({self._bundle_ct_per_node_list}, {kind} bundles "
            f"{self.bundle_resources()}, name={self._name!r})"
        )

    # ------------------------------------------------------------------ internals
    def _label(self) -> str:
        return f"({self._name!r})" if self._name else ""

    def _create_placement_groups(self, timeout_s: float) -> list[PlacementGroup]:
        """Ask Ray for every node's group at once (so they are scheduled together), then
        wait for all of them up to ``timeout_s``.  On expiry remove them (a pending group
        would otherwise keep reserving whatever part it did get) and raise."""
        bundle = self.bundle_resources()
        groups = [
            placement_group(
                [dict(bundle) for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self._name}-node{node}" if self._name else "",
            )
            for node, count in enumerate(self._bundle_ct_per_node_list)
        ]
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for pg in groups:
                _remove_quietly(pg)
            raise ResourcesUnavailableError(
                f"RayVirtualCluster{self._label()}: placement groups not granted within "
                f"{timeout_s} s ({len(ready)}/{len(groups)} ready). Asked for "
                f"{self._bundle_ct_per_node_list} bundles per node (each node's bundles on one "
                f"machine, STRICT_PACK), each bundle {bundle}; total "
                f"{_total(bundle, self.world_size())}. The cluster has "
                f"{_round(ray.cluster_resources())} in total, {_round(ray.available_resources())} "
                "available now."
            )
        return groups


@ray.remote(num_cpus=0)
def _node_ip_and_free_port() -> tuple[str, int]:
    """Runs inside a bundle: this node's IP and a port the OS just reported free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _check_bundle_counts(counts: Sequence[int]) -> None:
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence) or len(counts) == 0:
        raise ValueError(
            f"RayVirtualCluster: bundle_ct_per_node_list must be a non-empty list of bundle "
            f"counts, one per node, got {counts!r}"
        )
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 1]
    if bad:
        raise ValueError(
            f"RayVirtualCluster: every entry of bundle_ct_per_node_list must be an integer >= 1, got {list(counts)!r}"
        )


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def _remove_quietly(pg: PlacementGroup) -> None:
    """Remove ``pg``; a group that is already gone (e.g. Ray shut down) is not an error."""
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - teardown must not mask the error that caused it
        pass


def _total(bundle: dict[str, float], count: int) -> dict[str, float]:
    return {k: v * count for k, v in bundle.items()}


def _round(resources: dict[str, float]) -> dict[str, float | str]:
    """Resource dict for messages: without Ray's internal per-node / per-bundle keys, memory
    in GiB rather than bytes."""
    out: dict[str, float | str] = {}
    for key, value in sorted(resources.items()):
        if key.startswith("node:") or "_group_" in key:
            continue
        out[key] = f"{value / 2**30:.1f} GiB" if "memory" in key else round(value, 3)
    return out
