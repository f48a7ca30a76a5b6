"""PyTorch FSDP1 backend (FullyShardedDataParallel): only what differs from the other torch backend.

The worker class is imported on first use (:mod:`core.lazy_exports`): the driver reads the
backend's spec (``spec.py``) without importing torch."""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["FSDP1PolicyWorker"]
__getattr__, __dir__ = lazy_exports(__name__, {"FSDP1PolicyWorker": "worker"})

if TYPE_CHECKING:
    from backends.torch_fsdp.worker import FSDP1PolicyWorker
