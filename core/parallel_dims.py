"""One validated description of how the world of devices is split (torchtitan style).

Every backend names its mesh axes the same way::

    dp_replicate x fsdp x cp x tp == world_size

* ``dp_replicate`` -- pure data-parallel replicas (HSDP's replicate dimension),
* ``fsdp``         -- data parallel with sharded parameters/gradients/optimizer state,
* ``cp``           -- context parallel: the sequence is split across ranks,
* ``tp``           -- tensor parallel: weight matrices are split across ranks.

``dp = dp_replicate * fsdp`` is the number of distinct data shards: a global batch of
``B`` sequences gives every data-parallel rank ``B / dp`` of them, while the ``cp`` and
``tp`` ranks of one data-parallel group all see the same sequences.

One dimension may be ``-1``: it is filled in with whatever the others leave of
``world_size``.  A :class:`ParallelDims` instance is always resolved (no ``-1`` left).

This module imports neither torch nor jax: the torch backends build a ``DeviceMesh`` from
``mesh_shape()``/``mesh_axis_names()``, the JAX backend a ``jax.sharding.Mesh``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ParallelDims", "DP_REPLICATE", "FSDP", "CP", "TP", "AXIS_NAMES"]

DP_REPLICATE = "dp_replicate"
FSDP = "fsdp"
CP = "cp"
TP = "tp"
#: All axes, outermost first (the order of ``mesh_shape()``).
AXIS_NAMES = (DP_REPLICATE, FSDP, CP, TP)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the (dp_replicate, fsdp, cp, tp) device-mesh axes; product == world_size.

    Construct it directly or with :meth:`build` (same thing, keyword-only); a policy config's
    mesh is ``PolicyConfig.parallel_dims(world_size)``.  Raises ``ValueError`` naming the offending dimension.
    """

    world_size: int
    dp_replicate: int = 1
    fsdp: int = -1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        ws = self.world_size
        if not _is_int(ws) or ws < 1:
            raise ValueError(f"ParallelDims: world_size must be a positive integer, got {ws!r}")
        sizes = {name: getattr(self, name) for name in AXIS_NAMES}
        for name, size in sizes.items():
            if not _is_int(size) or (size < 1 and size != -1):
                raise ValueError(f"ParallelDims: {name} must be a positive integer (or -1 to fill in), got {size!r}")
        fill = [name for name, size in sizes.items() if size == -1]
        if len(fill) > 1:
            raise ValueError(f"ParallelDims: at most one dimension may be -1, got {' and '.join(fill)} ({_fmt(sizes)})")
        if fill:
            name = fill[0]
            others = {n: s for n, s in sizes.items() if n != name}
            prod = math.prod(others.values())
            if ws % prod != 0:
                raise ValueError(
                    f"ParallelDims: cannot fill {name}=-1: world_size {ws} is not divisible by "
                    f"{_fmt_product(others)} = {prod}"
                )
            object.__setattr__(self, name, ws // prod)
            sizes[name] = ws // prod
        prod = math.prod(sizes.values())
        if prod != ws:
            raise ValueError(f"ParallelDims: {_fmt_product(sizes)} = {prod} does not match world_size {ws}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def build(cls, world_size: int, *, dp_replicate: int = 1, fsdp: int = -1, cp: int = 1, tp: int = 1) -> ParallelDims:
        """A resolved instance (``-1`` filled in); ValueError if the sizes do not fit."""
        return cls(world_size=world_size, dp_replicate=dp_replicate, fsdp=fsdp, cp=cp, tp=tp)

    # ------------------------------------------------------------------ derived sizes
    @property
    def dp(self) -> int:
        """How many distinct data shards: ``dp_replicate * fsdp``."""
        return self.dp_replicate * self.fsdp

    @property
    def fsdp_cp(self) -> int:
        """Ranks parameters are sharded over when FSDP2 also shards across ``cp``."""
        return self.fsdp * self.cp

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    # ------------------------------------------------------------------ mesh description
    def axes(self, include_trivial: bool = False) -> dict[str, int]:
        """``{axis name: size}`` outermost first; size-1 axes only if ``include_trivial``."""
        return {name: getattr(self, name) for name in AXIS_NAMES if include_trivial or getattr(self, name) > 1}

    def mesh_shape(self, include_trivial: bool = False) -> tuple[int, ...]:
        """Mesh shape, outermost first.  Without ``include_trivial`` axes of size 1 are
        dropped (so a single device gives ``()``; pass ``True`` for a 4-d mesh)."""
        return tuple(self.axes(include_trivial).values())

    def mesh_axis_names(self, include_trivial: bool = False) -> tuple[str, ...]:
        """Axis names matching :meth:`mesh_shape` with the same ``include_trivial``."""
        return tuple(self.axes(include_trivial).keys())

    def __str__(self) -> str:
        return f"ParallelDims(world_size={self.world_size}: {_fmt(self.axes(True))}, dp={self.dp})"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fmt(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{n}={s}" for n, s in sizes.items())


def _fmt_product(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{n} ({s})" for n, s in sizes.items())
