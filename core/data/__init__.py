"""Batch containers shared by every backend.

Its names are imported on first use (:mod:`core.lazy_exports`): the config sections import
:mod:`core.data.sequence_packing`'s names without starting torch.
"""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["BatchedDataDict", "DynamicBatchingArgs", "SlicedDataDict"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BatchedDataDict": "batched_data_dict",
        "SlicedDataDict": "batched_data_dict",
        "DynamicBatchingArgs": "dynamic_batching",
    },
)

if TYPE_CHECKING:
    from core.data.batched_data_dict import BatchedDataDict, SlicedDataDict
    from core.data.dynamic_batching import DynamicBatchingArgs
