"""The train / validation datasets of SFT (sequences) and DPO (preference pairs) runs.

Same sources and splits as GRPO's prompts (:func:`core.datasets.base.build_datasets`); the
examples are encoded by :mod:`core.datasets.examples` against the sequence limit
``policy.max_total_sequence_length``.  Validation holds ``val_batches x
val_global_batch_size`` rows (DPO: half as many pairs).  The knobs of a built-in task are
``data.arithmetic``.
"""

from __future__ import annotations

from typing import Protocol

from core.datasets.base import EncodedDataset, build_datasets
from core.datasets.config import DataConfig
from core.datasets.examples import PreferenceEncoder, SFTEncoder


class ValidationSplit(Protocol):
    """What the ``sft`` / ``dpo`` sections say about the held-out rows."""

    val_batches: int
    val_global_batch_size: int
    seed: int


def build_sft_datasets(
    data: DataConfig, loop: ValidationSplit, tokenizer, *, max_length: int, exclude: frozenset[str] = frozenset()
) -> tuple[EncodedDataset, EncodedDataset]:
    """(train, validation) of ``SequenceDatum``; a built-in train stream never shows ``exclude``."""
    encoder = SFTEncoder(data, tokenizer, max_length)
    return _build(data, loop, "sft", encoder, rows_per_example=1, exclude=exclude)


def build_preference_datasets(
    data: DataConfig, loop: ValidationSplit, tokenizer, *, max_length: int, exclude: frozenset[str] = frozenset()
) -> tuple[EncodedDataset, EncodedDataset]:
    """(train, validation) of ``PreferenceDatum`` (each one pair = two rows of a batch)."""
    encoder = PreferenceEncoder(data, tokenizer, max_length)
    return _build(data, loop, "dpo", encoder, rows_per_example=2, exclude=exclude)


def _build(data: DataConfig, loop: ValidationSplit, section: str, encoder, *, rows_per_example: int, exclude):
    return build_datasets(
        data,
        data.arithmetic,
        encoder,
        num_val=loop.val_batches * loop.val_global_batch_size // rows_per_example,
        seed=loop.seed,
        num_val_key=f"{section}.val_batches",
        exclude=exclude,
        task_path="data.arithmetic",
    )
