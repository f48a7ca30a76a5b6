"""Checkpoints of every backend's worker: the backend's own sharded format (save / load, with the
step count and tokenizer), and the HF export with, under LoRA, the PEFT adapter beside it.

The engine writes and reads its own format (torch DCP, orbax) and its merged HF weights; what
the formats share -- the step count restored, the tokenizer files, the PEFT adapter directory
and its config, which rank writes -- is here.
"""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING, Any

from core.models.lora import peft_adapter_config, write_peft_adapter

if TYPE_CHECKING:
    import torch

    from core.policy.config import PolicyConfig

#: With policy.lora, the HF export's subdirectory holding the PEFT adapter (not the export
#: directory itself: transformers would then load the adapter on top of the merged weights).
LORA_ADAPTER_DIR = "lora_adapter"


class WorkerCheckpoint(abc.ABC):
    """``save_checkpoint``, ``load_checkpoint`` and ``save_hf_checkpoint`` (mixed into
    ``PolicyWorkerBase``)."""

    cfg: PolicyConfig
    rank: int
    tokenizer: Any
    train_step: int

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Collective: the backend's sharded weights (and optimizer state, schedule and step
        with ``optimizer_path``), atomic with a manifest; rank 0 adds the tokenizer files."""
        self._save_state(weights_path, optimizer_path)
        self._save_tokenizer(tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None, checksums: bool = True) -> None:
        """Collective: a verified restore (manifest, kinds, keys and shapes checked before any
        shard is read; ``CheckpointError`` naming the cause); the step count comes back too."""
        step = self._load_state(weights_path, optimizer_path, checksums, f"model {self.cfg.model_name!r}")
        if step is not None:
            self.train_step = step

    def save_hf_checkpoint(self, path: str, save_tokenizer: bool = False) -> None:
        """Collective: rank 0 writes HF safetensors that ``transformers`` (and every backend)
        loads, LoRA merged, and with LoRA the PEFT adapter in ``LORA_ADAPTER_DIR``."""
        self._write_hf_weights(path)
        if self.cfg.lora.enabled:
            adapters = self.lora_adapter_weights()  # a gather: every rank takes part
            if self.rank == 0:
                write_peft_adapter(os.path.join(path, LORA_ADAPTER_DIR), self._peft_config(), adapters)
        if save_tokenizer:
            self._save_tokenizer(path)
        self._wait_for_rank_zero()

    def _save_tokenizer(self, tokenizer_path: str | None) -> None:
        """Rank 0 writes the tokenizer files next to a checkpoint."""
        if tokenizer_path is not None and self.rank == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(tokenizer_path)

    def _peft_config(self) -> dict[str, Any]:
        """``adapter_config.json`` of this policy's adapters (``policy.lora``)."""
        lora = self.cfg.lora
        return peft_adapter_config(
            self.cfg.model_name, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.use_rslora
        )

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _save_state(self, weights_path: str, optimizer_path: str | None) -> None:
        """Collective: write the engine's checkpoint of the weights (and optimizer state, schedule, step)."""

    @abc.abstractmethod
    def _load_state(self, weights_path: str, optimizer_path: str | None, checksums: bool, what: str) -> int | None:
        """Collective: restore the engine's checkpoint; returns its step count (None if it has none)."""

    @abc.abstractmethod
    def _write_hf_weights(self, path: str) -> None:
        """Collective: gather the full weights (LoRA merged); rank 0 writes ``model.safetensors``
        and ``config.json`` to ``path``."""

    if TYPE_CHECKING:  # core.policy.worker_refit.WorkerAdapterRefit's

        def lora_adapter_weights(self) -> dict[str, torch.Tensor]: ...

    def _wait_for_rank_zero(self) -> None:
        """Block until rank 0's files are written (engines whose ranks can run ahead)."""
        return None  # one process per host writes, or each rank's own files: nothing to wait for
