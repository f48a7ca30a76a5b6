"""Convert NumPy test data to torch tensors or jax arrays, and take gradients on either.

Tests are written once and parametrised over ``ENGINES``; the float64 NumPy references
live in the test modules themselves.
"""

from __future__ import annotations

import contextlib

import numpy as np

ENGINES = ("torch", "jax")


def x64(engine: str):
    """Context in which float64 arrays stay float64 (jax needs x64 switched on)."""
    if engine == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


def to_engine(engine: str, value):
    """NumPy array / dict of arrays -> the engine's arrays (dtype kept)."""
    if isinstance(value, dict):
        return {k: to_engine(engine, v) for k, v in value.items()}
    if engine == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(value))
    import jax.numpy as jnp

    return jnp.asarray(value)


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def value_and_grad(engine: str, fn, x: np.ndarray):
    """(fn(x), d fn / d x) with the engine's autodiff; ``fn`` maps an engine array to a 0-d array."""
    if engine == "torch":
        import torch

        xt = torch.from_numpy(x.copy()).requires_grad_(True)
        out = fn(xt)
        out.backward()
        return float(out.detach()), xt.grad.numpy()
    import jax

    val, grad = jax.value_and_grad(fn)(to_engine("jax", x))
    return float(val), np.asarray(grad)
