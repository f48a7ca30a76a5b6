"""The driver-side policy: one facade over every training backend's Ray workers.

Its names are imported on first use (:mod:`core.lazy_exports`): the config section
(:mod:`core.policy.config`) is read on the driver before torch or Ray are needed.
"""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["BatchError", "BackendSpec", "NonFiniteStepError", "Policy", "backend_spec", "register_backend"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"BatchError": "checks", "NonFiniteStepError": "policy", "Policy": "policy", "BackendSpec": "backend_spec",
     "backend_spec": "registry", "register_backend": "registry"},
)  # fmt: skip

if TYPE_CHECKING:
    from core.policy.backend_spec import BackendSpec
    from core.policy.checks import BatchError
    from core.policy.policy import NonFiniteStepError, Policy
    from core.policy.registry import backend_spec, register_backend
