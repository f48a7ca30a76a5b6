"""The JAX backend's device mesh and the logical-axis -> mesh-axis machinery.

* :func:`make_mesh` builds the 3-d ``("fsdp", "cp", "tp")`` :class:`jax.sharding.Mesh` that
  ``policy.parallel`` asks for (sizes resolved by :class:`core.parallel_dims.ParallelDims`),
  with ``AxisType.Auto`` axes: jax 0.10 makes ``jax.make_mesh`` *Explicit* by default,
  which would turn every sharding into part of the array type; this backend relies on
  ``jit`` + ``with_sharding_constraint`` (GSPMD style) instead.
* Parameters and activations name their dimensions with the logical names of
  :mod:`backends.jax_pjit.logical_axes`; :func:`logical_to_mesh_spec` turns such a tuple
  into a :class:`~jax.sharding.PartitionSpec` through the one ``RULES`` table, and
  :func:`tree_shardings` does it for a whole parameter tree.
* :func:`check_divisible` reports, before anything is placed, which parameter dimension a
  mesh axis does not divide (e.g. 3 heads over ``tp=2``).
* :func:`activation_constraint` is the ``constrain(x, names)`` hook the model calls.
* :func:`shard_host_batch` puts a host (numpy / torch) batch onto the mesh, split by
  batch over ``fsdp``.
* Several JAX processes (``jax.process_count() > 1``, one per host): :func:`check_process_rows`
  refuses a mesh on which a process does not own whole ``fsdp`` rows, :func:`host_copy`
  gathers a full host copy of a sharded tree on every process, and :class:`HostShards`
  (:func:`to_host_shards` / :func:`from_host_shards`) keeps only this process's shards in
  host memory and puts them back.

Logical-axis trees are pytrees whose leaves are *tuples of names* (``("embed", "mlp")``),
``()`` for a scalar; a ``None`` leaf means "fully replicated".  Tuples are leaves here,
never containers: use dicts / lists for the tree structure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from backends.jax_pjit.logical_axes import RULES
from core.parallel_dims import CP, FSDP, TP, ParallelDims
from core.policy.config import PolicyConfig
from core.reporting import get_logger

__all__ = [
    "MESH_AXES",
    "make_mesh",
    "mesh_dims",
    "logical_to_mesh_spec",
    "logical_to_sharding",
    "tree_shardings",
    "check_divisible",
    "activation_constraint",
    "shard_host_batch",
    "check_process_rows",
    "host_copy",
    "HostShards",
    "to_host_shards",
    "from_host_shards",
    "stash",
    "unstash",
    "off_device",
    "is_logical_axes",
    "is_axes_leaf",
    "path_str",
    "shape_of",
    "spec_entries",
    "to_spec",
]

#: The mesh axes of the JAX backend, outermost first (``tp`` innermost: neighbouring devices).
MESH_AXES = (FSDP, CP, TP)

logger = get_logger(__name__)

Rules = Sequence[tuple[str, Any]] | Mapping[str, Any]
LogicalAxes = tuple[str | None, ...]


# ---------------------------------------------------------------------------------- mesh
def make_mesh(policy_cfg: PolicyConfig | Mapping[str, Any], devices: Sequence[Any] | None = None) -> Mesh:
    """The ``(fsdp, cp, tp)`` mesh of ``policy.parallel`` over ``devices`` (default ``jax.devices()``).

    ``parallel.fsdp_size`` may be ``-1`` (= number of devices / (``context_parallel_size`` x
    ``tensor_parallel_size``)).  Raises ``ValueError`` naming ``policy.parallel.fsdp_size`` /
    ``policy.parallel.context_parallel_size`` / ``policy.parallel.tensor_parallel_size`` when the
    sizes do not fit the device count.  All axes are ``AxisType.Auto``; ``tp`` is the inner
    axis so tensor-parallel peers are neighbouring devices, ``cp`` the next.  The ``cp`` axis
    is always present (size 1 without context parallelism).
    """
    policy_cfg = PolicyConfig.coerce(policy_cfg, "policy")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    backend = policy_cfg.backend
    if backend != "jax_pjit":
        raise ValueError(f"make_mesh: policy.backend is {backend!r}; the JAX mesh needs 'jax_pjit'")
    dims = mesh_dims(policy_cfg, len(devices))
    return _ordered_mesh((dims.fsdp, dims.cp, dims.tp), devices)


def mesh_dims(policy_cfg: PolicyConfig, n: int) -> ParallelDims:
    """``policy.parallel``'s mesh sizes on ``n`` devices; a ``ValueError`` naming the three
    fields when they do not fit (what the driver's check and :func:`make_mesh` both say)."""
    par = policy_cfg.parallel
    fsdp_size, tp_size, cp_size = par.fsdp_size, par.tensor_parallel_size, par.context_parallel_size
    try:
        return policy_cfg.parallel_dims(n)
    except ValueError as err:
        raise ValueError(
            f"policy.parallel.fsdp_size={fsdp_size!r} x policy.parallel.context_parallel_size={cp_size!r} x "
            f"policy.parallel.tensor_parallel_size={tp_size!r} does not fit {n} device(s) (fsdp_size x "
            f"context_parallel_size x tensor_parallel_size must equal the device count; fsdp_size=-1 "
            f"fills in): {err}"
        ) from err


def _ordered_mesh(shape: tuple[int, int, int], devices: list[Any]) -> Mesh:
    """The mesh in jax's topology-aware device order (``jax.make_mesh``: it matters on TPU and
    multi-slice GPU), or in the devices' own row-major order where jax cannot map ``shape``
    onto the physical topology -- it raises ``ValueError`` (e.g. devices of several slices)
    or ``NotImplementedError`` (a TPU torus it cannot split) then.  The sizes were checked
    above, so nothing else is expected; the order chosen is logged."""
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    sizes = dict(zip(MESH_AXES, shape, strict=True))
    try:
        mesh = jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError) as err:
        logger.warning(
            "JAX mesh %s on %d %s device(s): jax.make_mesh found no topology-aware device order (%s: %s); "
            "using the devices' row-major order",
            sizes,
            len(devices),
            devices[0].platform,
            type(err).__name__,
            err,
        )
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)
    logger.info(
        "JAX mesh %s on %d %s device(s): jax.make_mesh's device order", sizes, len(devices), devices[0].platform
    )
    return mesh


# ------------------------------------------------------------------ logical -> mesh specs
def _rules_dict(rules: Rules) -> dict[str, Any]:
    return dict(rules.items()) if isinstance(rules, Mapping) else dict(rules)


def _mesh_axes_of(rule: Any) -> tuple[str, ...]:
    if rule is None:
        return ()
    if isinstance(rule, str):
        return (rule,)
    return tuple(rule)


def is_logical_axes(x: Any) -> bool:
    """True for a leaf of a logical-axes tree: a tuple of names/None (``()`` included)."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def is_axes_leaf(x: Any) -> bool:
    return x is None or is_logical_axes(x)


def spec_entries(logical_axes: LogicalAxes, rules: Rules) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes that shard it (after dropping re-used mesh axes)."""
    if not is_logical_axes(logical_axes):
        raise TypeError(f"logical axes must be a tuple of names (str or None), got {logical_axes!r}")
    table = _rules_dict(rules)
    used: set[str] = set()
    entries = []
    for name in logical_axes:
        axes = _mesh_axes_of(table.get(name)) if name is not None else ()
        # A mesh axis may shard at most one dimension of an array: the first dimension
        # that asks for it gets it, later ones are replicated over it.
        kept = tuple(a for a in axes if a not in used)
        used.update(kept)
        entries.append(kept)
    return entries


def to_spec(entries: Sequence[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def logical_to_mesh_spec(logical_axes: LogicalAxes, rules: Rules = RULES) -> PartitionSpec:
    """``("embed", "mlp")`` -> ``PartitionSpec("fsdp", "tp")`` through ``rules``.

    One entry per dimension (``None`` = replicated).  Names absent from ``rules`` and
    ``None`` names are replicated.  A mesh axis may appear at most once in a spec: if two
    dimensions map to the same mesh axis (e.g. ``("mlp", "vocab")`` both -> ``tp``), the
    *first* keeps it and the later one is replicated.
    """
    return to_spec(spec_entries(logical_axes, rules))


def logical_to_sharding(logical_axes: LogicalAxes | None, mesh: Mesh, rules: Rules = RULES) -> NamedSharding:
    """The :class:`NamedSharding` on ``mesh`` for ``logical_axes`` (``None``: replicated)."""
    if logical_axes is None:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_mesh_spec(logical_axes, rules))


def tree_shardings(logical_axes_tree: Any, mesh: Mesh, rules: Rules = RULES) -> Any:
    """Map a tree of logical-axes tuples (tuples are leaves; ``None`` = replicated) to
    :class:`NamedSharding` s with the same structure -- e.g. for ``jax.device_put`` or a
    ``jit``'s ``in_shardings`` / ``out_shardings``."""
    return jax.tree.map(lambda axes: logical_to_sharding(axes, mesh, rules), logical_axes_tree, is_leaf=is_axes_leaf)


# ------------------------------------------------------------------------- divisibility
def path_str(path: Sequence[Any]) -> str:
    """A readable ``a/b/0/c`` form of a ``jax.tree_util`` key path (a final ``.value``
    attribute, the payload of a flax ``nnx.Variable``, is left out)."""
    path = list(path)
    if path and getattr(path[-1], "name", None) == "value":
        path = path[:-1]
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts) or "<root>"


def shape_of(x: Any) -> tuple[int, ...]:
    if hasattr(x, "shape"):
        return tuple(int(d) for d in x.shape)
    return tuple(int(d) for d in x)


def check_divisible(shapes_tree: Any, logical_axes_tree: Any, mesh: Mesh, rules: Rules = RULES) -> None:
    """Raise ``ValueError`` if a mesh axis does not divide the dimension it would shard.

    ``shapes_tree`` has the structure of ``logical_axes_tree``; its leaves are arrays,
    ``jax.ShapeDtypeStruct`` s (``jax.eval_shape``) or shape tuples.  The message lists every
    offending parameter path with the dimension, its logical name, its size and the mesh
    axis size, e.g. ``layers/0/attn/wq: dim 1 ('heads') has size 3, not divisible by mesh
    axis 'tp' of size 2``; a rank mismatch between a shape and its logical axes is reported
    the same way.
    """
    flat_axes, treedef = jax.tree_util.tree_flatten_with_path(logical_axes_tree, is_leaf=is_axes_leaf)
    try:
        flat_shapes = treedef.flatten_up_to(shapes_tree)  # type: ignore[attr-defined]  # jaxlib: no PyTreeDef stub
    except (ValueError, TypeError) as err:
        raise ValueError(f"check_divisible: the shapes tree does not match the logical axes tree: {err}") from err
    problems = []
    for (path, axes), leaf in zip(flat_axes, flat_shapes, strict=True):
        if axes is None:
            continue
        shape = shape_of(leaf)
        name = path_str(path)
        if len(shape) != len(axes):
            problems.append(f"{name}: shape {shape} has {len(shape)} dims but logical axes {axes} name {len(axes)}")
            continue
        for dim, (size, mesh_axes, logical) in enumerate(zip(shape, spec_entries(axes, rules), axes, strict=True)):
            for mesh_axis in mesh_axes:
                if mesh_axis not in mesh.shape:
                    problems.append(
                        f"{name}: dim {dim} ({logical!r}) maps to mesh axis {mesh_axis!r}, "
                        f"not in mesh {dict(mesh.shape)}"
                    )
            n = math.prod(mesh.shape[a] for a in mesh_axes if a in mesh.shape)
            if n > 1 and size % n != 0:
                what = " x ".join(f"{a!r}" for a in mesh_axes)
                problems.append(
                    f"{name}: dim {dim} ({logical!r}) has size {size}, not divisible by mesh axis {what} "
                    f"of size {n} ({logical}={size} % {'*'.join(mesh_axes)}={n} != 0)"
                )
    if problems:
        raise ValueError("parameter shapes do not fit the mesh " + f"{dict(mesh.shape)}:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------- activations
def _on_mesh(entries: Sequence[tuple[str, ...]], mesh: Mesh) -> list[tuple[str, ...]]:
    """Spec entries without the mesh axes ``mesh`` lacks, and without ``cp`` when it has size 1:
    the rules map the activations' ``seq`` to ``cp``, and without context parallelism every
    activation layout is then exactly the one of an ``(fsdp, tp)`` mesh (same programs)."""

    def keep(axis: str) -> bool:
        return axis in mesh.shape and (axis != CP or mesh.shape[axis] > 1)

    return [tuple(a for a in axes if keep(a)) for axes in entries]


def activation_constraint(
    mesh: Mesh, rules: Rules = RULES, *, strict: bool = False
) -> Callable[[jax.Array, LogicalAxes], jax.Array]:
    """The model's ``constrain(x, names)`` hook: ``with_sharding_constraint`` by logical names.

    ``names`` gives one logical name per dimension of ``x``.  With ``strict=False`` (the
    default) a mesh axis that does not divide the dimension it would shard (an odd
    sequence length, a micro batch smaller than ``fsdp``) is dropped for that call: the
    dimension is replicated instead of failing the trace.  ``strict=True`` raises.
    Mesh axes the mesh lacks, and ``cp`` of size 1, are left out (see :func:`_on_mesh`).
    """

    def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        if len(logical_axes) != x.ndim:
            raise ValueError(
                f"constrain: {x.ndim}-d array {x.shape} given {len(logical_axes)} logical axes {logical_axes}"
            )
        entries = []
        for dim, (size, axes) in enumerate(
            zip(x.shape, _on_mesh(spec_entries(logical_axes, rules), mesh), strict=True)
        ):
            n = math.prod(mesh.shape[a] for a in axes)
            if size % n != 0:
                if strict:
                    raise ValueError(
                        f"constrain: dim {dim} ({logical_axes[dim]!r}) of {x.shape} has size {size}, "
                        f"not divisible by mesh axis {'*'.join(axes)} of size {n}"
                    )
                axes = ()
            entries.append(axes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, to_spec(entries)))

    # ``layers.placement``: the one mesh axis (if one) a logical axis is split over -- the MoE
    # dispatches each device's rows alone over the batch's, and runs expert-parallel over the
    # experts'.
    def placement(name: str) -> tuple[Mesh, str] | None:
        axes = _on_mesh(spec_entries((name,), rules), mesh)[0]
        return (mesh, axes[0]) if len(axes) == 1 else None

    constrain.placement = placement  # type: ignore[attr-defined]
    return constrain


# ---------------------------------------------------------------------------- host data
def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array / torch tensor (CPU copy only if it lives elsewhere)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        import torch  # only reached when the caller already has torch loaded

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def shard_host_batch(
    array: Any, mesh: Mesh, logical_axes: LogicalAxes = ("batch", "seq"), rules: Rules = RULES
) -> jax.Array:
    """Place a host array (numpy or CPU torch tensor) on ``mesh``, dim 0 split over ``fsdp``.

    ``logical_axes`` names the leading dimensions; it is cut to the array's rank, and
    dimensions beyond it are replicated (so the default ``("batch", "seq")`` serves
    ``input_ids [B, S]`` and ``input_lengths [B]`` alike).  The batch must divide by the
    mesh axes it is split over (ValueError otherwise).

    Single process: ``array`` is the *global* batch and ``jax.device_put`` scatters it.
    Multi-process (``jax.process_count() > 1``): ``array`` is this process's slice and the
    global array is the concatenation of the processes' slices in process order
    (``jax.make_array_from_process_local_data``); every process must pass the same shape.
    """
    host = _to_numpy(array)
    names = tuple(logical_axes[: host.ndim]) + (None,) * max(0, host.ndim - len(logical_axes))
    entries = _on_mesh(spec_entries(names, rules), mesh)
    sharding = NamedSharding(mesh, to_spec(entries))
    nproc = jax.process_count()
    for dim, axes in enumerate(entries):
        n = math.prod(mesh.shape[a] for a in axes)
        global_size = host.shape[dim] * (nproc if (dim == 0 and nproc > 1) else 1)
        if global_size % n != 0:
            raise ValueError(
                f"shard_host_batch: dim {dim} ({names[dim]!r}) of size {global_size} is not divisible "
                f"by mesh axis {'*'.join(axes)} of size {n}"
            )
    if nproc == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_process_local_data(sharding, host)


# ------------------------------------------------------------------ several processes
def check_process_rows(mesh: Mesh) -> None:
    """Several processes: each must own whole, contiguous ``fsdp`` rows of ``mesh``.

    Every process feeds its own rows of the batch (the Policy shards batches over the
    processes), which become its part of the batch dimension split over ``fsdp``
    (``jax.make_array_from_process_local_data``).  A ``cp`` x ``tp`` block spanning two
    processes would make them feed different rows for one replicated slice: refused,
    naming the fields that size the block.
    """
    if jax.process_count() == 1:
        return
    owners = []
    for i in range(mesh.shape[FSDP]):
        procs = sorted({d.process_index for d in np.ravel(mesh.devices[i])})
        if len(procs) > 1:
            raise ValueError(
                f"multi-process JAX: the mesh {dict(mesh.shape)} puts fsdp row {i} on processes {procs}; every "
                f"process feeds its own batch rows, so policy.parallel.context_parallel_size x "
                f"policy.parallel.tensor_parallel_size must fit in one process's {jax.local_device_count()} devices"
            )
        owners.append(procs[0])
    runs = [p for k, p in enumerate(owners) if k == 0 or owners[k - 1] != p]
    if len(runs) != len(set(runs)):
        raise ValueError(
            f"multi-process JAX: the mesh's fsdp rows are owned by processes {owners}, not in one "
            f"contiguous run per process; a process's batch rows could not be placed in one piece"
        )


def host_copy(tree: Any) -> Any:
    """The full arrays of ``tree`` as host numpy, on this process (HF export, refit).

    One process: ``jax.device_get``.  Several: a leaf sharded over other processes' devices
    is all-gathered (``multihost_utils.process_allgather(tiled=True)``), one leaf at a time
    (the replicated copy of one leaf at a time is the transient device memory).  That is a
    collective: every process must call this with the same tree, in the same order.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(_host_leaf, tree)


def _host_leaf(x: Any) -> Any:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return jax.device_get(x)
    if x.is_fully_replicated:  # every device holds all of it: read a local one, no traffic
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)


@dataclasses.dataclass(frozen=True)
class HostShards:
    """This process's shards of one global array in host memory (:func:`to_host_shards`):
    each distinct block once, and which block each local device holds."""

    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    blocks: tuple[np.ndarray, ...]
    device_blocks: tuple[tuple[Any, int], ...]  # (local device, index into blocks)

    def to_device(self) -> jax.Array:
        arrays = [jax.device_put(self.blocks[i], device) for device, i in self.device_blocks]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)  # slices are unhashable before 3.12


def _leaf_shards(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    blocks: list[np.ndarray] = []
    seen: dict[tuple, int] = {}
    device_blocks = []
    for shard in x.addressable_shards:
        key = _index_key(shard.index)
        if key not in seen:  # a block replicated over local devices is stored once
            seen[key] = len(blocks)
            blocks.append(np.asarray(shard.data))
        device_blocks.append((shard.device, seen[key]))
    return HostShards(tuple(x.shape), x.sharding, tuple(blocks), tuple(device_blocks))


def to_host_shards(tree: Any) -> Any:
    """``tree`` with every ``jax.Array`` leaf replaced by its :class:`HostShards`.

    For state that goes back onto the same shardings (offload, the reference weights):
    no collective, and host memory for this process's share only, where :func:`host_copy`
    would gather every array to every process."""
    return jax.tree.map(_leaf_shards, tree)


def from_host_shards(tree: Any) -> Any:
    """The inverse of :func:`to_host_shards`: the global arrays, on their shardings again."""
    return jax.tree.map(
        lambda x: x.to_device() if isinstance(x, HostShards) else x, tree, is_leaf=lambda x: isinstance(x, HostShards)
    )


def stash(tree: Any) -> tuple[Any, Any]:
    """``tree`` in host memory, to go back onto the same shardings through :func:`unstash`
    (offloaded training state, the reference weights).

    One process: ``(numpy copy, shardings)``.  Several: ``(HostShards tree, None)``, only
    this process's shards -- no collective, and host memory for this host's share, where a
    full copy would gather every array to every host at each offload."""
    if jax.process_count() > 1:
        return to_host_shards(tree), None
    return jax.device_get(tree), jax.tree.map(lambda x: x.sharding, tree)


def unstash(host: Any, shardings: Any) -> Any:
    """The inverse of :func:`stash`: the arrays on their shardings again."""
    return from_host_shards(host) if shardings is None else jax.device_put(host, shardings)


def off_device(full: jax.Array) -> Any:
    """One (sharded) refit tensor as the stream carries it.  One process on GPU: gathered
    onto the first local GPU (device-to-device copies) and handed to torch by DLPack, no
    host trip (the CUDA IPC transport reads it there).  On CPU, a replicated array (one
    device included) goes to torch by DLPack too: a view of XLA's own host buffer, no copy.
    Else numpy: each shard copied to the host once, into the full array (several processes:
    all-gathered first, a collective).  Not a replicated jit output: on CPU that all-gather
    costs more than the host copy (docs/results.md#other-costs-the-comments-gave)."""
    device = jax.local_devices()[0]
    if jax.process_count() == 1 and device.platform == "gpu":
        import torch

        return torch.from_dlpack(jax.device_put(full, device))
    if device.platform == "cpu" and full.is_fully_replicated:
        import torch

        # numpy's view of this buffer is read-only, which torch.from_numpy warns about (it
        # has no read-only tensors); DLPack shares the same memory without that pretence.
        return torch.from_dlpack(full.addressable_data(0))
    if jax.process_count() == 1:
        return _assembled(full)
    return host_copy(full)


def _assembled(full: jax.Array) -> np.ndarray:
    """The full array in a new host array, each distinct shard copied into it once -- what
    ``jax.device_get`` does, but into an array of our own: jax's is read-only (it caches it
    on the Array), and torch.from_numpy warns on a read-only array."""
    out = np.empty(full.shape, full.dtype)
    seen: set[tuple] = set()
    for shard in full.addressable_shards:
        key = _index_key(shard.index)
        if key not in seen:  # a block replicated over several devices is copied once
            seen.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out
