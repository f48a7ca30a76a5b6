"""The one place that maps ``policy.backend`` to a worker class and a worker layout.

Worker classes are imported lazily: choosing ``torch_fsdp`` must not import jax, and the
driver process never needs to import a backend at all until it starts one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.distributed import WorkerLayout
from core.policy.config import BACKENDS, PolicyConfig


@dataclass(frozen=True)
class BackendSpec:
    """How to run one backend: where its worker class lives and how ranks map to axes."""

    worker: str  # "package.module:ClassName", imported on first use
    layout: Callable[[PolicyConfig, int], WorkerLayout]  # (policy config, n workers) -> layout
    one_worker_per_device: bool = True  # False: one worker per host owning all its devices (JAX)
    #: ``save_checkpoint``'s on-disk format (the manifest's ``identity.format``) and the files
    #: an optimizer checkpoint must hold besides the shards: checked on the driver at load.
    checkpoint_format: str = "torch-dcp"
    optimizer_files: tuple[str, ...] = ("scheduler_and_step.pt",)
    #: "package.module:function" ``(policy config, HF model config, cluster, workers) -> [line]``:
    #: what the backend refuses on the driver before its workers start (None: nothing of its own).
    driver_checks: str | None = None

    def load_worker(self) -> type:
        return _load(self.worker)

    def driver_problems(self, policy_cfg: PolicyConfig, model_config: Any, cluster: Any, workers: int) -> list[str]:
        """The backend's own driver-side checks (``driver_checks``), one line per problem."""
        return (
            []
            if self.driver_checks is None
            else list(_load(self.driver_checks)(policy_cfg, model_config, cluster, workers))
        )


def _load(target: str) -> Any:
    module_name, _, name = target.partition(":")
    return getattr(importlib.import_module(module_name), name)


def torch_layout(policy_cfg: PolicyConfig, world_size: int) -> WorkerLayout:
    """One rank per device; axes (dp, cp, tp) row-major, the same order as the device mesh."""
    dims = policy_cfg.parallel_dims(world_size)
    return WorkerLayout({"dp": dims.dp, "cp": dims.cp, "tp": dims.tp})


def host_layout(policy_cfg: PolicyConfig, n_workers: int) -> WorkerLayout:
    """One worker per host, each a data-parallel rank of the driver's sharding: the host's
    rows are then split over its local devices inside the worker's mesh."""
    return WorkerLayout({"dp": n_workers})


_REGISTRY: dict[str, BackendSpec] = {
    "torch_fsdp": BackendSpec("backends.torch_fsdp.worker:FSDP1PolicyWorker", torch_layout),
    "torch_dtensor": BackendSpec("backends.torch_dtensor.worker:DTensorPolicyWorker", torch_layout),
    "jax_pjit": BackendSpec(
        "backends.jax_pjit.worker:JaxPolicyWorker",
        host_layout,
        one_worker_per_device=False,
        checkpoint_format="orbax",
        optimizer_files=(),
        driver_checks="backends.jax_pjit.driver_checks:policy_problems",
    ),
}


def register_backend(name: str, spec: BackendSpec) -> None:
    """Add (or replace) a backend; ``name`` must be one of the config's ``BACKENDS``."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}; add it to core.policy.config.BACKENDS first")
    _REGISTRY[name] = spec


def backend_spec(name: str) -> BackendSpec:
    if name not in _REGISTRY:
        known = sorted(_REGISTRY)
        missing = "" if name not in BACKENDS else " (declared in the config schema but not implemented yet)"
        raise ValueError(f"policy.backend={name!r} has no registered worker{missing}; available: {known}")
    return _REGISTRY[name]
