"""What core knows of a training backend: one :class:`BackendSpec` object per backend.

A backend package declares its spec in a module that imports only ``core`` and pydantic
(``backends/<name>/spec.py``), so the driver validates a config, places workers and checks
checkpoints without importing torch model code or jax; the worker class is imported only when
a ``Policy`` starts it.  Specs are found by package entry point (:mod:`core.policy.registry`),
the built-in ones the same way as a plug-in's.

Core asks the spec questions instead of branching on a backend's name: which shared options it
implements (:mod:`core.policy.options`; the rest are refused by name), how its parallel sizes
become a mesh and its workers a layout, whether a worker owns one device or a whole host, which
optimizer classes it maps, what its checkpoints look like, and its own checks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.config import ConfigModel, Problem
from core.parallel_dims import ParallelDims
from core.policy.options import OPTION_KEYS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from core.distributed.layout import WorkerLayout
    from core.distributed.virtual_cluster import RayVirtualCluster
    from core.policy.config import PolicyConfig

#: ``(policy) -> problems``: rules that need neither the device count nor the model.
StaticCheck = Callable[["PolicyConfig"], Iterable[Problem]]
#: ``(policy, world size) -> problems``: rules of the mesh against the devices.
LayoutCheck = Callable[["PolicyConfig", int], Iterable[Problem]]
#: ``(policy, the model's HF config) -> problems``: rules against the model (driver preflight).
ModelCheck = Callable[["PolicyConfig", "PreTrainedConfig"], Iterable[Problem]]
#: ``(policy, the model's HF config, cluster, workers) -> problems``: rules that need the devices
#: the workers will own (``Policy``, on the driver, before they start).
DriverCheck = Callable[["PolicyConfig", "PreTrainedConfig", "RayVirtualCluster", int], Iterable[Problem]]


def no_problems(*_: Any) -> Iterable[Problem]:
    return ()


def mesh_dims(policy: PolicyConfig, world_size: int) -> ParallelDims:
    """``policy.parallel`` on ``world_size`` devices: tp and cp as given, fsdp the rest (or
    ``fsdp_size``, which must then fit exactly)."""
    p = policy.parallel
    return ParallelDims.build(world_size, fsdp=p.fsdp_size, cp=p.context_parallel_size, tp=p.tensor_parallel_size)


def device_layout(policy: PolicyConfig, world_size: int) -> WorkerLayout:
    """One worker per device; axes (dp, cp, tp) row-major, the order of the device mesh."""
    from core.distributed.layout import WorkerLayout

    dims = policy.parallel_dims(world_size)
    return WorkerLayout({"dp": dims.dp, "cp": dims.cp, "tp": dims.tp})


def host_layout(policy: PolicyConfig, n_workers: int) -> WorkerLayout:
    """One worker per host, each a data-parallel rank of the driver's sharding: the host's
    rows are split over its local devices inside the worker's mesh."""
    from core.distributed.layout import WorkerLayout

    return WorkerLayout({"dp": n_workers})


@dataclass(frozen=True)
class BackendSpec:
    """How to run, check and name one training backend."""

    name: str
    """``policy.backend`` / ``--backend``."""
    worker: str
    """``"package.module:Class"`` of its policy worker, imported on first use."""
    layout_prefix: str
    """First word of its layout names (``benchmarks.lib.layouts``: ``<prefix>-<data axis><D>-...``)."""
    data_axis: str = "dp"
    """How its layout names call the data-parallel (sharded) axis."""
    supports: frozenset[str] = frozenset()
    """The options of :data:`core.policy.options.OPTIONS` it implements; the others are refused."""
    why_not: Mapping[str, str] = field(default_factory=dict)
    """Option key -> why it is refused here (said in the refusal and the docs table)."""
    config_key: str | None = None
    """Its own block, ``policy.<config_key>``, for settings no other backend has."""
    config_block: type[ConfigModel] | None = None
    """The block's model (validated wherever the block appears, whatever the backend)."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Its old spellings (dotted below ``policy``) -> the one key that replaced each: refused
    with a message naming the new key."""
    one_worker_per_device: bool = True
    """False: one worker per host, owning all of the host's devices."""
    optimizers: tuple[str, ...] | None = None
    """``policy.optimizer.name`` values it maps (None: any importable class, e.g. torch.optim.*)."""
    schedulers: tuple[str, ...] | None = None
    """``policy.scheduler[*].name`` values it maps (None: any importable class)."""
    sliding_window_rows: bool = False
    """Whether packed and context-parallel rows keep a model's sliding attention windows (False:
    those layouts are refused for a model with sliding-window layers)."""
    checkpoint_format: str = "torch-dcp"
    """``save_checkpoint``'s on-disk format (the manifest's ``identity.format``)."""
    optimizer_files: tuple[str, ...] = ("scheduler_and_step.pt",)
    """Files an optimizer checkpoint holds besides its shards (checked on the driver at load)."""
    checks: StaticCheck = no_problems
    """Its own rules of the policy section (paths relative to ``policy``)."""
    layout_checks: LayoutCheck = no_problems
    """Its own rules of the mesh against the world size (run after the shared ones pass)."""
    model_checks: ModelCheck = no_problems
    """Its own rules against the model's HF config, on the driver before any worker starts."""
    driver_checks: DriverCheck = no_problems
    """Its own rules of the mesh its workers will build over the devices they will own, and of
    the model's weights on that mesh, on the driver before any worker starts (where a worker owns
    a whole host, the device count is known only from the cluster)."""
    parallel_dims: Callable[[PolicyConfig, int], ParallelDims] = mesh_dims
    """How ``policy.parallel`` becomes its mesh on a world size."""
    worker_layout: Callable[[PolicyConfig, int], WorkerLayout] | None = None
    """How its workers are laid out (None: :func:`device_layout` or :func:`host_layout`)."""
    devices_per_worker: Callable[[RayVirtualCluster], int] | None = None
    """How many devices each of its workers will own on a cluster, where a worker owns a whole
    host (None: one, a worker per device).  With the worker count, the world its mesh spans."""

    def __post_init__(self) -> None:
        unknown = sorted((set(self.supports) | set(self.why_not)) - OPTION_KEYS)
        if unknown:
            raise ValueError(f"backend {self.name!r}: {unknown} are not policy options; known: {sorted(OPTION_KEYS)}")
        if (self.config_key is None) != (self.config_block is None):
            raise ValueError(f"backend {self.name!r}: config_key and config_block go together")

    def layout(self, policy: PolicyConfig, n_workers: int) -> WorkerLayout:
        """The layout of ``n_workers`` workers running ``policy``."""
        if self.worker_layout is not None:
            return self.worker_layout(policy, n_workers)
        return (device_layout if self.one_worker_per_device else host_layout)(policy, n_workers)

    def data_parallel_size(self, policy: PolicyConfig, cluster: RayVirtualCluster, n_workers: int) -> int:
        """Data-parallel ranks of ``policy``'s mesh on ``n_workers`` workers of ``cluster``,
        counted in devices: every one of them runs ``policy.train_micro_batch_size`` rows per
        micro batch, whichever worker owns it."""
        per_worker = 1 if self.devices_per_worker is None else self.devices_per_worker(cluster)
        return self.parallel_dims(policy, n_workers * per_worker).dp

    def load_worker(self) -> type:
        module_name, _, cls_name = self.worker.partition(":")
        return getattr(importlib.import_module(module_name), cls_name)

    @property
    def worker_class_name(self) -> str:
        return self.worker.partition(":")[2]
