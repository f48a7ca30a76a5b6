"""Where each parameter is stored on the mesh: the rules table's choice, unless a mesh axis that
only stores parameters does not divide the dimension the table gives it.

The rules (:mod:`backends.jax_pjit.logical_axes`) give every parameter dimension its mesh axis:
``embed`` and ``expert`` over ``fsdp``, ``heads`` / ``mlp`` / ``vocab`` over ``tp``.  The two
kinds of axis are not alike:

* ``fsdp`` (and ``cp``, which splits no parameter) only *store* weights: every step gathers a
  weight before it computes with it (GSPMD inserts the all-gather; the MoE's ``shard_map``
  takes its kernels replicated), so where a weight is split over them changes memory and the
  gathers' layout, never the math.  When the preferred dimension is not divisible -- a tiny
  Qwen3-MoE's 4 experts over ``fsdp`` 8, which both torch backends run -- the weight keeps that
  axis on **another dimension it divides** (the first one in order that no other mesh axis
  splits, e.g. the experts' model dimension: how a dense MLP's kernels are stored), so its
  memory is still split ``fsdp`` ways.  Only when no dimension divides is it **replicated** over
  the axis (correct, at the cost of that weight's memory on every rank).  Expert parallelism
  (``policy.parallel.expert_parallel_size``) runs over the experts' storage axis and needs it
  there; the config refuses a size that does not divide the experts before this is reached.
* ``tp`` is compute: the attention and MLP run split along the heads / MLP width it shards.
  A ``tp`` that does not divide its dimension cannot run that way, and is a problem
  (:attr:`Placement.problems`), refused on the driver before any worker starts
  (:mod:`backends.jax_pjit.driver_checks`); the vocabulary is padded for ``tp`` beforehand.

:func:`plan_placement` works on shapes alone (arrays, ``ShapeDtypeStruct`` s or tuples) and
mesh axis sizes, so the driver plans the abstract model exactly as the worker places the real one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from backends.jax_pjit.logical_axes import RULES
from backends.jax_pjit.sharding import Rules, is_axes_leaf, path_str, shape_of, spec_entries, to_spec
from core.parallel_dims import CP, FSDP, TP
from core.reporting import get_logger

__all__ = ["AXIS_FIELDS", "STORAGE_AXES", "Placement", "place_params", "plan_placement"]

logger = get_logger(__name__)

#: Mesh axes that only store parameters (gathered before every use): a weight may keep them on
#: another dimension, or be replicated over them.
STORAGE_AXES = (FSDP, CP)
#: The ``policy`` field that sizes each mesh axis (for messages).
AXIS_FIELDS = {
    FSDP: "parallel.fsdp_size",
    CP: "parallel.context_parallel_size",
    TP: "parallel.tensor_parallel_size",
}


@dataclass(frozen=True)
class Placement:
    """Every parameter's :class:`PartitionSpec` (in the order of the logical-axes tree), the
    weights stored another way than the rules prefer, and what cannot be placed at all."""

    treedef: Any
    specs: tuple[PartitionSpec, ...]
    moved: tuple[tuple[str, str], ...]
    """``(parameter path, how it is stored instead)`` for each weight that moved a storage axis."""
    problems: tuple[tuple[str, str], ...]
    """``(policy field, message)`` per parameter dimension a compute axis does not divide."""

    def shardings(self, mesh: Mesh) -> Any:
        """The tree of :class:`NamedSharding` s on ``mesh`` (the logical-axes tree's structure)."""
        return self.treedef.unflatten([NamedSharding(mesh, spec) for spec in self.specs])

    def summary(self) -> list[str]:
        """One line per way weights moved, with how many did (``moved`` grouped)."""
        counts = Counter(how for _, how in self.moved)
        first: dict[str, str] = {}
        for path, how in self.moved:
            first.setdefault(how, path)
        return [f"{how}: {n} weight(s), e.g. {first[how]}" for how, n in counts.items()]


def plan_placement(shapes_tree: Any, axes_tree: Any, mesh_sizes: Mapping[str, int], rules: Rules = RULES) -> Placement:
    """:class:`Placement` of the parameters whose shapes are ``shapes_tree`` (the structure of
    ``axes_tree``, whose leaves are logical-axes tuples, ``None`` = replicated) on a mesh of
    ``mesh_sizes`` (``{"fsdp": 8, "cp": 1, "tp": 1}``)."""
    flat_axes, treedef = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=is_axes_leaf)
    try:
        flat_shapes = treedef.flatten_up_to(shapes_tree)  # type: ignore[attr-defined]  # jaxlib: no PyTreeDef stub
    except (ValueError, TypeError) as err:
        raise ValueError(f"plan_placement: the shapes tree does not match the logical axes tree: {err}") from err
    specs, moved, problems = [], [], []
    for (path, axes), leaf in zip(flat_axes, flat_shapes, strict=True):
        name = path_str(path)
        if axes is None:
            specs.append(PartitionSpec())
            continue
        shape = shape_of(leaf)
        if len(shape) != len(axes):
            raise ValueError(f"{name}: shape {shape} has {len(shape)} dims but logical axes {axes} name {len(axes)}")
        entries, notes, wrong = _place(name, shape, axes, mesh_sizes, rules)
        specs.append(to_spec(entries))
        moved += [(name, note) for note in notes]
        problems += wrong
    return Placement(treedef, tuple(specs), tuple(moved), tuple(problems))


def _place(
    name: str, shape: Sequence[int], axes: Sequence[str | None], sizes: Mapping[str, int], rules: Rules
) -> tuple[list[tuple[str, ...]], list[str], list[tuple[str, str]]]:
    """One parameter: its per-dimension mesh axes, how storage axes moved, what cannot fit."""
    entries = [[a for a in dim_axes if sizes.get(a, 1) > 1] for dim_axes in spec_entries(tuple(axes), rules)]
    homeless: list[tuple[str, int]] = []
    problems: list[tuple[str, str]] = []
    for dim, dim_axes in enumerate(entries):
        if shape[dim] % _size(dim_axes, sizes) == 0:
            continue
        for axis in [a for a in dim_axes if a in STORAGE_AXES]:
            dim_axes.remove(axis)
            homeless.append((axis, dim))
        if shape[dim] % _size(dim_axes, sizes):
            what = " x ".join(f"{a} ({sizes[a]})" for a in dim_axes)
            problems.append(
                (
                    AXIS_FIELDS.get(dim_axes[-1], dim_axes[-1]),
                    f"{name}: dim {dim} ({axes[dim]!r}) has size {shape[dim]}, not divisible by mesh axis {what}; "
                    "tensor parallelism computes along that dimension, so it must divide it",
                )
            )
    notes = [_rehome(axis, dim, shape, axes, entries, sizes) for axis, dim in homeless]
    return [tuple(e) for e in entries], notes, problems


def _rehome(
    axis: str,
    dim: int,
    shape: Sequence[int],
    axes: Sequence[str | None],
    entries: list[list[str]],
    sizes: Mapping[str, int],
) -> str:
    """Put storage ``axis`` (taken off ``dim``) on the first other dimension it divides, an
    unsplit one first; else leave the weight replicated over it.  Returns what was done."""
    size = sizes[axis]
    why = f"{axis} ({size}) does not divide {axes[dim]!r} ({shape[dim]})"
    others = [d for d in range(len(shape)) if d != dim]
    for d in sorted(others, key=lambda d: bool(entries[d])):  # unsplit dimensions first, then in order
        if shape[d] % (_size(entries[d], sizes) * size) == 0:
            entries[d].append(axis)
            return f"{why}: stored split over {axis} along {axes[d]!r} instead"
    return f"{why} nor any other dimension: replicated over {axis}"


def _size(axes: Sequence[str], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def place_params(params: Any, axes_tree: Any, mesh: Mesh, rules: Rules = RULES) -> Any:
    """The worker's side: the shardings of ``params`` on ``mesh`` (logging the weights that
    moved); a ``ValueError`` listing what cannot fit -- which the driver refuses first, so
    reaching it means the driver's check and this plan disagree."""
    placement = plan_placement(params, axes_tree, dict(mesh.shape), rules)
    if placement.problems:
        lines = [f"policy.{field}: {message}" for field, message in placement.problems]
        raise ValueError(f"parameter shapes do not fit the mesh {dict(mesh.shape)}:\n  " + "\n  ".join(lines))
    for line in placement.summary():
        logger.info("JAX parameter placement on %s: %s", dict(mesh.shape), line)
    return placement.shardings(mesh)
