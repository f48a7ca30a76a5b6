"""The few array primitives the kernel suite needs, for torch tensors and jax arrays.

The kernels and losses are written once against this small vocabulary; ``ops_for(x)``
picks the engine from the array type.  It is deliberately narrow (~30 functions), not a
general array API: each entry exists because a kernel (or the per-step metric collector,
``core.losses.metrics``) uses it, and each has the same meaning on both engines (including
how gradients flow through it).

Neither torch nor jax is imported at module import time: a torch-only worker never
pays for jax, and vice versa.
"""

from __future__ import annotations

import sys
from typing import Any

# Reductions over masks divide by (count + EPS) exactly as NeMo RL does, so an all-masked
# batch gives exactly 0 instead of 0/0.
EPS = 1e-8


class TorchOps:
    """Primitives on ``torch.Tensor`` (autograd flows through all but ``stop_gradient``)."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.t = torch

    # --- dtypes -----------------------------------------------------------------------
    def compute_dtype(self, x):
        """float32 for low-precision floats, else the array's own float dtype (fp64 stays)."""
        t = self.t
        return t.float64 if x.dtype == t.float64 else t.float32

    def to_compute(self, x):
        return x.to(self.compute_dtype(x))

    def astype(self, x, dtype):
        return x.to(dtype)

    def is_integer(self, x) -> bool:
        return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == self.t.bool)

    # --- elementwise --------------------------------------------------------------------
    def exp(self, x):
        return self.t.exp(x)

    def expm1(self, x):
        return self.t.expm1(x)

    def log(self, x):
        return self.t.log(x)

    def abs(self, x):
        return self.t.abs(x)

    def square(self, x):
        return self.t.square(x)

    def log_sigmoid(self, x):
        return self.t.nn.functional.logsigmoid(x)

    def where(self, cond, a, b):
        return self.t.where(cond, a, b)

    def clip(self, x, lo=None, hi=None):
        return self.t.clamp(x, min=lo, max=hi)

    def maximum(self, a, b):
        return self.t.maximum(a, b)

    def minimum(self, a, b):
        return self.t.minimum(a, b)

    def isfinite(self, x):
        return self.t.isfinite(x)

    def nan_to_num(self, x):
        return self.t.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    # --- reductions and indexing -------------------------------------------------------
    def sum(self, x, axis=None, keepdims=False):
        if axis is None:
            return x.sum()
        return x.sum(dim=axis, keepdim=keepdims)

    def amax(self, x, axis=-1, keepdims=False):
        return x.amax(dim=axis, keepdim=keepdims)

    def logsumexp(self, x, axis=-1, keepdims=False):
        return self.t.logsumexp(x, dim=axis, keepdim=keepdims)

    def take_along_last(self, x, idx):
        """``x[..., idx]`` per position: x [..., V], idx [...] int -> [...]."""
        return self.t.gather(x, -1, idx.unsqueeze(-1).long()).squeeze(-1)

    def log_softmax_at(self, x, idx):
        """``log_softmax(x)[..., idx]``.  Through torch's fused log_softmax kernel: on CPU it
        is faster than gather(x) - logsumexp(x), whose logsumexp materialises exp(x)
        (docs/results.md#kernels-attention-and-moe-dispatch)."""
        return self.take_along_last(self.t.log_softmax(x, dim=-1), idx)

    def softmax(self, x):
        return self.t.softmax(x, dim=-1)

    # Trailing underscore: may overwrite (and return) its first argument, which must be a
    # temporary the caller owns.  torch does it in place (no extra chunk-sized buffers,
    # a faster backward on CPU); jax, being functional, returns a new array.
    def mul_(self, x, y):
        return x.mul_(y)

    def add_at_last_(self, x, idx, vals):
        """``x[..., idx] += vals`` per position."""
        return x.scatter_add_(-1, idx.unsqueeze(-1).long(), vals.unsqueeze(-1).to(x.dtype))

    def gather_last(self, x, idx):
        """``x[..., idx[..., k]]`` for every k: x [..., V], idx [..., K] int -> [..., K]."""
        return self.t.gather(x, -1, idx.long())

    def moveaxis(self, x, source, destination):
        return self.t.movedim(x, source, destination)

    def top_k_indices(self, x, k):
        """Indices [..., k] of the ``k`` largest entries of the last axis (largest first)."""
        return self.t.topk(x, k, dim=-1).indices

    def one_hot(self, idx, n, dtype):
        """[..., n] indicator of ``idx`` [...] (no gradient flows through it)."""
        return self.t.nn.functional.one_hot(idx.long(), n).to(dtype)

    def concat(self, xs, axis):
        return self.t.cat(list(xs), dim=axis)

    def zeros_like(self, x, dtype=None):
        return self.t.zeros_like(x, dtype=dtype)

    def ones_like(self, x, dtype=None):
        return self.t.ones_like(x, dtype=dtype)

    def zeros(self, shape, like):
        return self.t.zeros(shape, dtype=like.dtype, device=like.device)

    def arange(self, n, like):
        return self.t.arange(n, device=like.device)

    def expand_dims(self, x, axis):
        return x.unsqueeze(axis)

    def stop_gradient(self, x):
        return x.detach()

    # --- host-side inspection ------------------------------------------------------------
    def count_true(self, mask):
        """Number of True entries, as a 0-d integer array (no host sync)."""
        return mask.sum()

    def is_concrete(self, x) -> bool:
        return x.device.type != "meta"

    def to_python(self, x):
        return x.item()

    def read_floats(self, parts):
        """Each array of ``parts`` as a flat list of Python floats, through one device->host
        copy (each ``.item()`` would wait for the device separately)."""
        t = self.t
        flat = t.cat([p.detach().reshape(-1).to(t.float64) for p in parts])
        values = flat.tolist()  # the one synchronisation
        out, start = [], 0
        for p in parts:
            out.append(values[start : start + p.numel()])
            start += p.numel()
        return out


class JaxOps:
    """Primitives on ``jax.Array`` (usable inside ``jax.jit`` and under ``jax.grad``)."""

    name = "jax"

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jax = jax
        self.jnp = jnp

    def compute_dtype(self, x):
        jnp = self.jnp
        return jnp.float64 if x.dtype == jnp.float64 else jnp.float32

    def to_compute(self, x):
        return x.astype(self.compute_dtype(x))

    def astype(self, x, dtype):
        return self.jnp.asarray(x).astype(dtype)

    def is_integer(self, x) -> bool:
        return self.jnp.issubdtype(x.dtype, self.jnp.integer)

    def exp(self, x):
        return self.jnp.exp(x)

    def expm1(self, x):
        return self.jnp.expm1(x)

    def log(self, x):
        return self.jnp.log(x)

    def abs(self, x):
        return self.jnp.abs(x)

    def square(self, x):
        return self.jnp.square(x)

    def log_sigmoid(self, x):
        return self.jax.nn.log_sigmoid(x)

    def where(self, cond, a, b):
        return self.jnp.where(cond, a, b)

    def clip(self, x, lo=None, hi=None):
        return self.jnp.clip(x, lo, hi)

    def maximum(self, a, b):
        return self.jnp.maximum(a, b)

    def minimum(self, a, b):
        return self.jnp.minimum(a, b)

    def isfinite(self, x):
        return self.jnp.isfinite(x)

    def nan_to_num(self, x):
        return self.jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    def sum(self, x, axis=None, keepdims=False):
        return self.jnp.sum(x, axis=axis, keepdims=keepdims)

    def amax(self, x, axis=-1, keepdims=False):
        return self.jnp.max(x, axis=axis, keepdims=keepdims)

    def logsumexp(self, x, axis=-1, keepdims=False):
        return self.jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)

    def take_along_last(self, x, idx):
        return self.jnp.take_along_axis(x, idx[..., None].astype(self.jnp.int32), axis=-1)[..., 0]

    def log_softmax_at(self, x, idx):
        """``log_softmax(x)[..., idx]`` as x[idx] - logsumexp(x): XLA fuses this into one
        reduction pass (faster than materialising log_softmax, and no [.., V] buffer)."""
        return self.take_along_last(x, idx) - self.logsumexp(x, axis=-1)

    def softmax(self, x):
        return self.jax.nn.softmax(x, axis=-1)

    def mul_(self, x, y):
        return x * y

    def add_at_last_(self, x, idx, vals):
        """``x[..., idx] += vals`` per position (scatter-add: faster than a one-hot)."""
        grid = self.jnp.indices(idx.shape, sparse=True)
        return x.at[(*grid, idx)].add(vals.astype(x.dtype))

    def gather_last(self, x, idx):
        return self.jnp.take_along_axis(x, idx.astype(self.jnp.int32), axis=-1)

    def moveaxis(self, x, source, destination):
        return self.jnp.moveaxis(x, source, destination)

    def top_k_indices(self, x, k):
        return self.jax.lax.top_k(x, k)[1]

    def one_hot(self, idx, n, dtype):
        return self.jax.nn.one_hot(idx, n, dtype=dtype)

    def concat(self, xs, axis):
        return self.jnp.concatenate(list(xs), axis=axis)

    def zeros_like(self, x, dtype=None):
        return self.jnp.zeros_like(x, dtype=dtype)

    def ones_like(self, x, dtype=None):
        return self.jnp.ones_like(x, dtype=dtype)

    def zeros(self, shape, like):
        return self.jnp.zeros(shape, dtype=like.dtype)

    def arange(self, n, like):
        return self.jnp.arange(n)

    def expand_dims(self, x, axis):
        return self.jnp.expand_dims(x, axis)

    def stop_gradient(self, x):
        return self.jax.lax.stop_gradient(x)

    def count_true(self, mask):
        return self.jnp.sum(mask)

    def is_concrete(self, x) -> bool:
        return not isinstance(x, self.jax.core.Tracer)

    def to_python(self, x):
        return x.item()

    def read_floats(self, parts):
        """Each array of ``parts`` as a flat list of Python floats; ``device_get`` of all of
        them starts every transfer before waiting on any."""
        import numpy as np

        return [np.asarray(a, np.float64).reshape(-1).tolist() for a in self.jax.device_get(list(parts))]


_OPS: dict[str, Any] = {}


def _engine_of(x) -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    return None


def ops_for(*arrays):
    """The ops of the engine owning ``arrays`` (torch or jax); mixing engines is an error."""
    engines = {e for e in map(_engine_of, arrays) if e is not None}
    if len(engines) != 1:
        kinds = sorted({type(a).__module__ + "." + type(a).__name__ for a in arrays})
        if not engines:
            raise TypeError(f"expected torch tensors or jax arrays, got {kinds}")
        raise TypeError(f"arrays from different engines cannot be mixed: {kinds}")
    engine = engines.pop()
    if engine not in _OPS:
        _OPS[engine] = TorchOps() if engine == "torch" else JaxOps()
    return _OPS[engine]
