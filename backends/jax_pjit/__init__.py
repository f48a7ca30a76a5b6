"""JAX backend: flax model, mesh + logical-axis rules, jitted steps, optax, orbax.

The worker class is imported on first use (:mod:`core.lazy_exports`): the driver reads the
backend's spec (``spec.py``) without importing jax."""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["JaxPolicyWorker"]
__getattr__, __dir__ = lazy_exports(__name__, {"JaxPolicyWorker": "worker"})

if TYPE_CHECKING:
    from backends.jax_pjit.worker import JaxPolicyWorker
