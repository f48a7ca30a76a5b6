"""PyTorch DTensor backend: FSDP2 fully_shard on a (dp, cp, tp) mesh plus tensor/sequence/context parallel.

The worker class is imported on first use (:mod:`core.lazy_exports`): the driver reads the
backend's spec (``spec.py``) without importing torch."""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["DTensorPolicyWorker"]
__getattr__, __dir__ = lazy_exports(__name__, {"DTensorPolicyWorker": "worker"})

if TYPE_CHECKING:
    from backends.torch_dtensor.worker import DTensorPolicyWorker
