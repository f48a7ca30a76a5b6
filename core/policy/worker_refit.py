"""LoRA adapter-only refit and the adapter export, for every backend's worker.

With ``policy.lora.refit`` the engine holds the unmerged base weights once and then receives
only the adapters, under PEFT's names.  An engine supplies its adapters in stored names
(``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight`` [out, r]) and their metadata;
the PEFT naming, the stream and the host copies for the export are written here once.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch

from core.models.lora import peft_name
from core.refit.packing import as_torch
from core.refit.sender import RefitSender


class WorkerAdapterRefit(RefitSender):
    """The adapter stream of a refit and the adapters of an HF export (mixed into ``PolicyWorkerBase``)."""

    def _adapter_refit_info(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """PEFT adapter name -> (shape, dtype), in stream order."""
        return {peft_name(name): meta for name, meta in self._adapter_meta().items()}

    def _iter_adapter_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: ``(PEFT adapter name, full A [r, in] or B [out, r])`` in ``dtype``."""
        for name, tensor in self._iter_adapter_tensors(dtype):
            yield peft_name(name), tensor

    def lora_adapter_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the full adapter weights by stored name, as host torch tensors."""
        return {name: as_torch(tensor).to("cpu") for name, tensor in self._iter_adapter_tensors(None)}

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _adapter_meta(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Stored adapter name -> (full shape, dtype), in the order ``_iter_adapter_tensors`` yields."""

    @abc.abstractmethod
    def _iter_adapter_tensors(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: ``(stored adapter name, full tensor)`` of every adapter in ``dtype``
        (None: as stored), on every rank."""
