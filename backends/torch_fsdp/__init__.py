"""PyTorch FSDP1 backend (FullyShardedDataParallel): only what differs from the other torch backend."""
