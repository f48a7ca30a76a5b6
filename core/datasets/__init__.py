"""Training data: sources, encoded datasets (GRPO prompts, SFT sequences, DPO pairs), loaders.

``build_prompt_datasets`` (GRPO), ``build_sft_datasets`` and ``build_preference_datasets``
give the train and validation datasets of a run; ``BatchLoader`` draws batches from one with
a position that checkpoints and resumes exactly.  Importing this package imports neither
``datasets`` nor any training backend (those load lazily, when a source is read).
"""

from core.datasets.base import EncodedDataset, ListDataset, build_datasets, encode_rows
from core.datasets.loader import BatchLoader
from core.datasets.prompts import (
    PromptDatum,
    PromptEncoder,
    build_prompt_datasets,
    build_prompt_eval_dataset,
    chat_template_used,
    format_prompt,
    tokenize_prompt,
)
from core.datasets.sources import BUILTIN_SOURCES, DatasetLoadError, builtin_rows, load_rows

__all__ = [
    "BUILTIN_SOURCES",
    "BatchLoader",
    "DatasetLoadError",
    "EncodedDataset",
    "ListDataset",
    "PromptDatum",
    "PromptEncoder",
    "build_datasets",
    "build_prompt_datasets",
    "build_prompt_eval_dataset",
    "builtin_rows",
    "chat_template_used",
    "encode_rows",
    "format_prompt",
    "load_rows",
    "tokenize_prompt",
]
