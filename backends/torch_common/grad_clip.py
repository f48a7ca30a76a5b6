"""Global gradient-norm clipping that is correct under FSDP2 and tensor parallelism.

With DTensor parameters (FSDP2 shards, TP shards) the per-parameter norms are DTensors:
``torch.nn.utils.get_total_norm`` reduces them over their mesh, summing the squares of a
*sharded* parameter's shards but counting a parameter that is *replicated* over a mesh
axis once.  Parameters can live on different meshes (TP-planned weights on the 2-D
(dp, tp) mesh, norms that TP leaves alone on the 1-D dp mesh), and DTensor ops cannot mix
meshes, so the squared norms are reduced per mesh and then added.  FSDP1's flat
parameters are plain local shards; FSDP1 uses its own ``clip_grad_norm_`` instead (see
``backends.torch_fsdp``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` (DTensors on any meshes, or replicated plain tensors)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_dtensor(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clip gradients in place to ``max_norm`` (``None``: only measure) and return the total
    L2 norm before clipping, identical on every rank, as a 0-d tensor on the gradients'
    device (no host sync: the caller reads it with the step's other values)."""
    grads = [g for g in (p.grad for p in parameters) if g is not None]
    if not grads:
        return torch.zeros(())
    total = total_grad_norm(grads)
    if max_norm is not None and math.isfinite(max_norm):
        # clip_grads_with_norm_ scales each grad by one scalar: DTensor grads of any mesh
        # accept a plain 0-d coefficient.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total
