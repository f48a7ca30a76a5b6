"""PyTorch DTensor backend: FSDP2 fully_shard on a (dp, tp) mesh plus tensor/sequence parallel."""

from backends.torch_dtensor.worker import DTensorPolicyWorker

__all__ = ["DTensorPolicyWorker"]
