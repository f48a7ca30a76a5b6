"""PyTorch DTensor backend: FSDP2 fully_shard on a (dp, tp) mesh plus tensor/sequence/context parallel."""
