"""Where a run's workers go: the training cluster, and the generation engines' place.

``cluster.gpus_per_node`` x ``cluster.num_nodes`` devices (on a CPU machine: worker slots).
A backend runs one worker per device, or (its spec's ``one_worker_per_device`` false) one
worker per node owning all of the node's devices, whose cluster then has one bundle per node
holding them all.  Generation is either *colocated*
(the engines share the training bundles: weights move by ``ipc``, and the policy offloads
while the engines run) or on its own cluster (``generation.colocated.resources``: weights
move by ``collective`` broadcast) -- the transport follows the placement.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from core.algorithms.config import MasterConfig
from core.distributed import RayVirtualCluster, ray_init
from core.distributed.worker_output import WORKER_LOG_FILENAME
from core.policy.generation_config import ColocationResources

if TYPE_CHECKING:
    from core.refit.driver import Transport


def uses_vllm(cfg: MasterConfig) -> bool:
    return cfg.policy.generation is not None and cfg.policy.generation.backend == "vllm"


def is_colocated(cfg: MasterConfig) -> bool:
    gen = cfg.policy.generation
    return gen is None or gen.colocated.enabled


def refit_transport(cfg: MasterConfig) -> Transport:
    return "ipc" if is_colocated(cfg) else "collective"


def start_ray(cfg: MasterConfig) -> None:
    """Start Ray for this run (joining ``RAY_ADDRESS`` if set).

    A worker that owns its host's devices (a JAX worker) sees, on a CPU machine, as many XLA
    devices as ``XLA_FLAGS`` asks for when it first imports jax, and Ray's workers inherit the
    environment of the process that starts Ray -- so the device count
    (``cluster.gpus_per_node``) is given to :func:`core.distributed.ray_init.start_ray`, which
    sets it before ``ray.init`` unless the caller already chose one.

    The workers' own output (vLLM's and the libraries' start-up chatter) goes to
    ``<logger.log_dir>/workers.log``, not between the progress bar's lines: see
    :mod:`core.distributed.worker_output` (errors still reach the console).
    """
    import ray

    if ray.is_initialized():
        return
    on_gpu = _has_gpu()
    per_host = not cfg.policy.spec.one_worker_per_device
    jax_devices = cfg.cluster.gpus_per_node if per_host and not on_gpu else None
    ray_init.start_ray(
        num_cpus=None if on_gpu else max(os.cpu_count() or 1, cpu_slots_needed(cfg)),
        jax_cpu_devices=jax_devices,
        worker_log=worker_log_path(cfg),
    )


def worker_log_path(cfg: MasterConfig) -> Path | None:
    """Where a run's worker processes write their stdout/stderr (None: Ray's default)."""
    return Path(cfg.logger.log_dir) / WORKER_LOG_FILENAME if cfg.logger is not None else None


def cpu_slots_needed(cfg: MasterConfig) -> int:
    """Logical CPUs a CPU-only run asks Ray for: the training slots, plus the engines' own
    slots when generation is not colocated.  May exceed the cores: on a CPU machine a slot
    is a process, and the OS shares the cores between them."""
    slots = cfg.cluster.world_size * cfg.cluster.cpus_per_slot
    gen = cfg.policy.generation
    if gen is not None and uses_vllm(cfg) and not is_colocated(cfg):
        resources = gen.colocated.resources
        slots += (resources.gpus_per_node or 1) * (resources.num_nodes or 1)
    return slots


def _has_gpu() -> bool:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def policy_cluster(cfg: MasterConfig, name: str = "policy") -> RayVirtualCluster:
    """The training cluster (shared with the engines when generation is colocated, and with
    the distillation teacher's workers)."""
    cluster = cfg.cluster
    per_node, nodes, cpus = cluster.gpus_per_node, cluster.num_nodes, cluster.cpus_per_slot
    share = colocated_groups(cfg)
    if not cfg.policy.spec.one_worker_per_device:
        return RayVirtualCluster(
            [1] * nodes, num_cpus_per_bundle=per_node * cpus, max_colocated_worker_groups=share, name=name
        )
    return RayVirtualCluster([per_node] * nodes, num_cpus_per_bundle=cpus, max_colocated_worker_groups=share, name=name)


def colocated_groups(cfg: MasterConfig) -> int:
    """Worker groups sharing each training bundle: the policy's, colocated engines', and the
    frozen distillation teacher's (``grpo.distillation``)."""
    groups = 2 if uses_vllm(cfg) and is_colocated(cfg) else 1
    if cfg.grpo is not None and cfg.grpo.distillation.enabled:
        groups += 1
    return groups


def generation_cluster(cfg: MasterConfig, name: str = "generation") -> RayVirtualCluster:
    """The engines' own cluster when generation is not colocated."""
    resources = cfg.policy.generation.colocated.resources if cfg.policy.generation else ColocationResources()
    per_node = resources.gpus_per_node or 1
    nodes = resources.num_nodes or 1
    return RayVirtualCluster([per_node] * nodes, name=name)
