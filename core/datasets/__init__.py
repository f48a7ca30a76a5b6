"""Prompt data for RL post-training: sources, tokenized prompt datasets, batch loaders.

``build_prompt_datasets(master_cfg, tokenizer, num_val=..., seed=...)`` gives the train
and validation ``PromptDataset``s of a run; ``PromptLoader`` draws batches from one with a
position that checkpoints and resumes exactly.  Importing this package imports neither
``datasets`` nor any training backend (those load lazily, when a source is read).
"""

from core.datasets.loader import PromptLoader
from core.datasets.prompts import (
    PromptDataset,
    PromptDatum,
    build_prompt_datasets,
    chat_template_used,
    format_prompt,
    tokenize_prompt,
)
from core.datasets.sources import BUILTIN_SOURCES, DatasetLoadError, builtin_rows, load_rows

__all__ = [
    "BUILTIN_SOURCES",
    "DatasetLoadError",
    "PromptDataset",
    "PromptDatum",
    "PromptLoader",
    "build_prompt_datasets",
    "builtin_rows",
    "chat_template_used",
    "format_prompt",
    "load_rows",
    "tokenize_prompt",
]
