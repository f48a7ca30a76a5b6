"""Ranks of a worker group as coordinates on named axes (``dp`` / ``cp`` / ``tp``).

:class:`~core.distributed.worker_group.RayWorkerGroup` places its ranks by such a layout and
shards a call's data over some of its axes (``run_all_workers_sharded_data``); the policy
registry builds one per backend (``core.policy.registry``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["WorkerLayout"]


class WorkerLayout:
    """Ranks as coordinates on named axes, row-major (the last axis varies fastest).

    ``WorkerLayout({"dp": 2, "tp": 2})``: ranks 0,1 are ``dp=0`` with ``tp=0,1``; ranks 2,3
    are ``dp=1``.  Same convention as ``torch.distributed.init_device_mesh`` with
    ``mesh_dim_names=("dp", "tp")``, so tensor-parallel neighbours are consecutive ranks
    (and therefore share a node when nodes hold consecutive ranks).

    Args:
        sizes: ``{axis name: size}`` outermost first; at least one axis, sizes >= 1.
    Raises ``ValueError`` naming the offending axis.
    """

    def __init__(self, sizes: Mapping[str, int]) -> None:
        if not isinstance(sizes, Mapping) or not sizes:
            raise ValueError(f"WorkerLayout: need a non-empty {{axis: size}} mapping, got {sizes!r}")
        for name, size in sizes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"WorkerLayout: axis names must be identifiers, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"WorkerLayout: axis {name!r} must have an integer size >= 1, got {size!r}")
        self._names = tuple(sizes)
        self._sizes = tuple(int(s) for s in sizes.values())
        # stride of axis i = product of the sizes of the axes inside it (row-major)
        self._strides = tuple(math.prod(self._sizes[i + 1 :]) for i in range(len(self._sizes)))

    @classmethod
    def data_parallel(cls, world_size: int) -> WorkerLayout:
        """All ranks on one ``dp`` axis (the default of :class:`RayWorkerGroup`)."""
        return cls({"dp": world_size})

    @property
    def world_size(self) -> int:
        return math.prod(self._sizes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    def has_axis(self, name: str) -> bool:
        return name in self._names

    def axis_size(self, name: str) -> int:
        """Size of axis ``name``; ValueError if the layout has no such axis."""
        return self._sizes[self._index(name)]

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: coordinate}`` of ``rank``; ValueError if out of range."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"WorkerLayout: rank {rank!r} is out of range [0, {self.world_size})")
        return {
            name: (rank // stride) % size
            for name, size, stride in zip(self._names, self._sizes, self._strides, strict=True)
        }

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._sizes, strict=True))
        return f"WorkerLayout({axes})"

    # ------------------------------------------------------------------ internals
    def _index(self, name: str) -> int:
        try:
            return self._names.index(name)
        except ValueError:
            raise ValueError(f"WorkerLayout: unknown axis {name!r}; axes are {list(self._names)}") from None
