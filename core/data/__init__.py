"""Batch containers shared by every backend (torch and ray/jax free to import)."""

from core.data.batched_data_dict import BatchedDataDict, SlicedDataDict
from core.data.dynamic_batching import DynamicBatchingArgs

__all__ = ["BatchedDataDict", "DynamicBatchingArgs", "SlicedDataDict"]
