"""The train / validation datasets of SFT (sequences) and DPO (preference pairs) runs.

Same sources and splits as GRPO's prompts (:func:`core.datasets.base.build_datasets`); the
examples are encoded by :mod:`core.datasets.examples` against the sequence limit
``policy.max_total_sequence_length``.  Validation holds ``val_batches x
val_global_batch_size`` rows (DPO: half as many pairs).  The knobs of a built-in task are
``data.arithmetic``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.datasets.base import EncodedDataset, build_datasets
from core.datasets.examples import PreferenceEncoder, SFTEncoder


def build_sft_datasets(
    cfg: Mapping[str, Any], tokenizer, *, exclude: frozenset[str] = frozenset()
) -> tuple[EncodedDataset, EncodedDataset]:
    """(train, validation) of ``SequenceDatum``; a built-in train stream never shows ``exclude``."""
    encoder = SFTEncoder(cfg["data"], tokenizer, cfg["policy"]["max_total_sequence_length"])
    return _build(cfg, "sft", encoder, rows_per_example=1, exclude=exclude)


def build_preference_datasets(
    cfg: Mapping[str, Any], tokenizer, *, exclude: frozenset[str] = frozenset()
) -> tuple[EncodedDataset, EncodedDataset]:
    """(train, validation) of ``PreferenceDatum`` (each one pair = two rows of a batch)."""
    encoder = PreferenceEncoder(cfg["data"], tokenizer, cfg["policy"]["max_total_sequence_length"])
    return _build(cfg, "dpo", encoder, rows_per_example=2, exclude=exclude)


def _build(cfg, section: str, encoder, *, rows_per_example: int, exclude: frozenset[str]):
    s, data = cfg[section], cfg["data"]
    num_val = s["val_batches"] * s["val_global_batch_size"] // rows_per_example
    return build_datasets(
        data,
        data.get("arithmetic"),
        encoder,
        num_val=num_val,
        seed=s["seed"],
        num_val_key=f"{section}.val_batches",
        exclude=exclude,
        task_path="data.arithmetic",
    )
