"""The driver-side policy: one facade over every training backend's Ray workers."""

from core.policy.checks import BatchError
from core.policy.policy import NonFiniteStepError, Policy
from core.policy.registry import BackendSpec, backend_spec, register_backend

__all__ = ["BatchError", "BackendSpec", "NonFiniteStepError", "Policy", "backend_spec", "register_backend"]
