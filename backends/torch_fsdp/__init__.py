"""PyTorch FSDP1 backend (FullyShardedDataParallel): only what differs from the other torch backend."""

from backends.torch_fsdp.worker import FSDP1PolicyWorker

__all__ = ["FSDP1PolicyWorker"]
