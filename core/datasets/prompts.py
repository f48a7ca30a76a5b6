"""Text rows -> tokenized prompts (GRPO): templates, chat templates, length limits.

``build_prompt_datasets`` turns the ``data`` section of a GRPO run's config into a train and
a validation dataset of ``PromptDatum`` (the split itself is :mod:`core.datasets.base`'s).
Every configuration or data problem it can detect is raised here, before any training
starts, with the dotted config key that fixes it.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.datasets.base import EncodedDataset, build_datasets, build_eval_dataset
from core.datasets.config import DataConfig
from core.environments.config import ArithmeticTaskConfig


@dataclass(frozen=True)
class PromptDatum:
    """One prompt ready for generation."""

    prompt: str  # the text fed to the tokenizer (after prompt_template + chat template)
    input_ids: tuple[int, ...]
    metadata: dict[str, Any]  # ground_truth, index, raw_prompt + the row's other columns


def chat_template_used(data_cfg: DataConfig, tokenizer) -> bool:
    """Whether ``data.use_chat_template`` (auto | true | false) applies the chat template."""
    mode = data_cfg.use_chat_template
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "auto":
        return has_template
    if mode is True and not has_template:
        raise ValueError(
            f"data.use_chat_template: true, but the tokenizer {tokenizer_name(tokenizer)} has "
            f"no chat_template; use a chat model's tokenizer or set data.use_chat_template: auto"
        )
    return bool(mode)


def format_prompt(text: str, data_cfg: DataConfig, tokenizer) -> str:
    """Apply ``data.prompt_template`` and, when used, the tokenizer's chat template."""
    template = data_cfg.prompt_template
    _check_template(template)
    content = template.format(prompt=text)
    system = data_cfg.system_prompt
    if not chat_template_used(data_cfg, tokenizer):
        if system:
            # Dropping it silently would train on prompts the user did not ask for.
            raise ValueError(
                f"data.system_prompt is set but no chat template is applied (tokenizer "
                f"{tokenizer_name(tokenizer)}, data.use_chat_template: "
                f"{data_cfg.use_chat_template}); put the text in "
                f"data.prompt_template instead"
            )
        return content
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompt(text: str, tokenizer, used_chat_template: bool) -> list[int]:
    """Token ids of a formatted prompt.

    Special tokens (BOS, ...) are added only without a chat template: a rendered chat
    template already contains them, and adding them again would double the BOS.
    """
    ids = tokenizer(text, add_special_tokens=not used_chat_template)["input_ids"]
    return [int(t) for t in ids]


def _check_template(template: str) -> None:
    """``data.prompt_template`` must be a str.format template using exactly ``{prompt}``."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(
            f"data.prompt_template: {template!r} is not a valid str.format "
            f"template ({e}); write literal braces as {{{{ and }}}}"
        ) from None
    if fields != {"prompt"}:
        raise ValueError(
            f"data.prompt_template: {template!r} must use the field {{prompt}} "
            f"and no other (found {sorted(fields)}); write literal braces as "
            f"{{{{ and }}}}"
        )


def tokenizer_name(tokenizer) -> str:
    path = getattr(tokenizer, "name_or_path", "") or "<unnamed>"
    return f"{type(tokenizer).__name__}({path!r})"


class PromptEncoder:
    """Turns one text row into a ``PromptDatum`` under the ``data`` config (or drops it)."""

    def __init__(self, data_cfg: DataConfig, tokenizer):
        if data_cfg.max_input_seq_length is None:
            raise ValueError("data.max_input_seq_length: required for prompts (the longest prompt in tokens)")
        self.prompt_key = data_cfg.prompt_column
        self.answer_key = data_cfg.answer_key
        self.limit = data_cfg.max_input_seq_length
        self.limit_key, self.drop_note = "data.max_input_seq_length", "data.on_long_prompt=filter"
        self.filter = data_cfg.on_long_prompt == "filter"
        format_prompt("", data_cfg, tokenizer)  # surfaces template / chat-template errors now
        self._cfg, self._tokenizer = data_cfg, tokenizer
        self._chat = chat_template_used(data_cfg, tokenizer)

    def check_columns(self, row: Mapping, source: str) -> None:
        """The configured prompt / answer columns must exist (checked on the first row)."""
        for key, column in (("prompt_key", self.prompt_key), ("answer_key", self.answer_key)):
            if column is not None and column not in row:
                raise ValueError(f"data.{key}: column {column!r} is not in {source}; available columns: {sorted(row)}")

    def encode(self, row: Mapping, index: int, source: str) -> PromptDatum | None:
        """The row as a datum, or None when it is too long and ``on_long_prompt`` is filter."""
        text = row.get(self.prompt_key)
        if not isinstance(text, str):
            raise ValueError(
                f"data.prompt_key: row {index} of {source} has {type(text).__name__}"
                f" in column {self.prompt_key!r}, not text"
            )
        prompt = format_prompt(text, self._cfg, self._tokenizer)
        ids = tokenize_prompt(prompt, self._tokenizer, self._chat)
        if len(ids) > self.limit:
            if self.filter:
                return None
            raise ValueError(
                f"data.max_input_seq_length: row {index} of {source} is {len(ids)} tokens, over "
                f"the limit of {self.limit}; raise data.max_input_seq_length or set "
                f"data.on_long_prompt: filter to drop such rows"
            )
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        metadata.update(ground_truth=self._answer(row, index, source), index=index, raw_prompt=text)
        return PromptDatum(prompt=prompt, input_ids=tuple(ids), metadata=metadata)

    def _answer(self, row: Mapping, index: int, source: str) -> str | None:
        if self.answer_key is None:
            return None
        if row.get(self.answer_key) is None:  # a reward against "None" would be silently wrong
            raise ValueError(f"data.answer_key: row {index} of {source} has no value in column {self.answer_key!r}")
        return str(row[self.answer_key])


def build_prompt_datasets(
    data: DataConfig, task: ArithmeticTaskConfig | None, tokenizer, *, num_val: int, seed: int
) -> tuple[EncodedDataset, EncodedDataset]:
    """The (train, validation) prompt datasets of a GRPO run (``task``: the knobs of a built-in
    source, ``env.arithmetic``); see ``build_datasets``."""
    return build_datasets(
        data,
        task,
        PromptEncoder(data, tokenizer),
        num_val=num_val,
        seed=seed,
        num_val_key="grpo.max_val_samples",
    )


def build_prompt_eval_dataset(
    data: DataConfig,
    task: ArithmeticTaskConfig | None,
    tokenizer,
    name: str,
    split: str | None,
    *,
    num_builtin: int,
    seed: int,
) -> EncodedDataset:
    """The prompts of ``name`` to evaluate on (``dualrl eval --dataset``), encoded under the run's
    ``data`` section: a built-in task's held-out problems (those a GRPO run of ``seed`` with
    ``grpo.max_val_samples`` = ``num_builtin`` validates on) or every row of a file / hub split
    (None: ``data.split``)."""
    return build_eval_dataset(
        data,
        task,
        PromptEncoder(data, tokenizer),
        name,
        split,
        num_builtin=num_builtin,
        seed=seed,
        key_path="dualrl eval --dataset",
    )
