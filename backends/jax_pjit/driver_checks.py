"""What the JAX backend refuses on the driver, before any worker starts.

A JAX worker owns all of its host's devices and builds its mesh over every device of the
group, so two things are known only once the devices are: whether ``policy.parallel``'s mesh
matches their count, and whether every weight can be placed on that mesh
(:mod:`backends.jax_pjit.param_placement`: a storage axis that does not divide a weight's
dimension moves; a tensor-parallel one cannot).  Both used to surface inside the worker, as a
start-up failure of the whole group; :func:`policy_problems` finds them on the driver from the
cluster, the config and the model's HF config alone (the model is built abstractly: shapes,
no memory, no device).

The backend's spec (``backends.jax_pjit.spec``, ``driver_checks``) calls it from ``Policy``
before the worker group starts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from core.config import Problem
from core.parallel_dims import ParallelDims
from core.policy.config import PolicyConfig

if TYPE_CHECKING:
    from core.distributed import RayVirtualCluster

__all__ = ["host_device_count", "placement_problems", "policy_problems"]

#: The XLA flag that gives a CPU host its device count (``core.distributed.ray_init`` sets it).
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def host_device_count(cluster: RayVirtualCluster) -> int:
    """Devices one JAX worker of ``cluster`` will see: its bundle's GPUs, or on CPU the XLA
    host devices a Ray worker process of this job gets (read by a zero-CPU task from the
    environment the actors inherit: ``JAX_NUM_CPU_DEVICES``, else ``XLA_FLAGS``; jax's default 1)."""
    if cluster.use_gpus:
        return int(cluster.bundle_resources().get("GPU", 1))
    import ray

    @ray.remote(num_cpus=0)
    def device_env() -> tuple[str | None, str | None]:
        import os

        return os.environ.get("JAX_NUM_CPU_DEVICES"), os.environ.get("XLA_FLAGS")

    num_cpu_devices, flags = ray.get(device_env.remote())
    if num_cpu_devices not in (None, "", "-1"):
        return int(num_cpu_devices)
    counts = _DEVICE_FLAG.findall(flags or "")
    return int(counts[-1]) if counts else 1


def placement_problems(policy: PolicyConfig, hf_config: Any, dims: ParallelDims) -> list[Problem]:
    """What of the model's weights cannot be placed on the ``dims`` mesh (``(field, message)``,
    field under ``policy``): the abstract model (vocabulary padded for tp as the worker pads
    it) planned as the worker places the real one."""
    from flax import nnx

    from backends.jax_pjit.models import abstract_model, config_from_hf, logical_axes_tree
    from backends.jax_pjit.param_placement import plan_placement

    cfg = config_from_hf(hf_config).with_padded_vocab(dims.tp, int(policy.make_vocab_size_divisible_by or 1))
    params = nnx.state(abstract_model(cfg), nnx.Param)
    placement = plan_placement(params, logical_axes_tree(params), {"fsdp": dims.fsdp, "cp": dims.cp, "tp": dims.tp})
    return list(placement.problems)


def policy_problems(policy: PolicyConfig, hf_config: Any, cluster: RayVirtualCluster, workers: int) -> list[Problem]:
    """Every driver-side problem of a JAX policy on ``workers`` workers of ``cluster`` (fields
    under ``policy``): the mesh against the group's devices (the shared rules and the backend's
    own, e.g. expert parallelism over fsdp), then the weights' placement on it."""
    devices = workers * host_device_count(cluster)
    where = f" ({workers} worker(s) x {devices // workers} device(s) each)"
    # layout_problems' last rule holds as on a worker per device: every data-parallel device runs
    # train_micro_batch_size rows per micro batch (the worker's micro batch: that many per device).
    mesh = [(field, message + where) for field, message in policy.layout_problems(devices)]
    return mesh or placement_problems(policy, hf_config, policy.parallel_dims(devices))
