"""Text rows -> tokenized prompts: templates, chat templates, length limits, splits.

``build_prompt_datasets`` turns the ``data`` section of a run's config into a train and a
validation ``PromptDataset``.  Every configuration or data problem it can detect is raised
here, before any training starts, with the dotted config key that fixes it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import string
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.datasets.sources import (
    builtin_candidates,
    builtin_task,
    is_builtin,
    load_rows,
    problem_row,
)

# How many candidate problems a built-in item / the validation draw may reject (held out,
# duplicate, too long) before we conclude the configuration cannot produce prompts.
_MAX_REJECTS = 1000


@dataclass(frozen=True)
class PromptDatum:
    """One prompt ready for generation."""

    prompt: str  # the text fed to the tokenizer (after prompt_template + chat template)
    input_ids: tuple[int, ...]
    metadata: dict[str, Any]  # ground_truth, index, raw_prompt + the row's other columns


class PromptDataset(abc.ABC):
    """Random access to prompts; finite (``size`` = count) or infinite (``size`` None)."""

    size: int | None = None
    num_filtered: int = 0  # rows dropped by ``data.on_long_prompt: filter``

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError("infinite PromptDataset has no len(); check .size (None)")
        return self.size

    def __bool__(self) -> bool:  # without this, bool() would call __len__ and raise
        return self.size is None or self.size > 0

    def __getitem__(self, i: int) -> PromptDatum:
        if self.size is not None and i < 0:
            i += self.size
        if i < 0 or (self.size is not None and i >= self.size):
            raise IndexError(f"prompt index {i} out of range (size {self.size})")
        datum = self._get(int(i))
        # A fresh metadata dict per access: callers may annotate it without changing the data.
        return dataclasses.replace(datum, metadata=dict(datum.metadata))

    @abc.abstractmethod
    def _get(self, i: int) -> PromptDatum:
        """Item ``i`` (already range-checked)."""


class ListPromptDataset(PromptDataset):
    """A finite dataset whose prompts were all formatted and tokenized up front."""

    def __init__(self, items: list[PromptDatum], num_filtered: int = 0):
        self._items = list(items)
        self.size = len(self._items)
        self.num_filtered = num_filtered

    def _get(self, i: int) -> PromptDatum:
        return self._items[i]


class GeneratedPromptDataset(PromptDataset):
    """The infinite train stream of a built-in task: item i is a pure function of (seed, i).

    Item i is the first of ``builtin_candidates(task, seed, i)`` whose prompt is not held
    out for validation and (with ``on_long_prompt: filter``) fits the length limit.
    """

    def __init__(self, task, seed: int, encoder: _Encoder, held_out: frozenset[str], name: str):
        self._task, self._seed, self._encoder = task, seed, encoder
        self._held_out, self._name = held_out, name
        self.size = None
        encoder.check_columns(problem_row(task.problem(seed, 0)), f"built-in task {name!r}")
        # Bounded cache: the stream is infinite, but the loop re-reads recent items.
        self._cached = functools.lru_cache(maxsize=8192)(self._generate)

    def _get(self, i: int) -> PromptDatum:
        return self._cached(i)

    def _generate(self, i: int) -> PromptDatum:
        source = f"built-in task {self._name!r} (seed {self._seed})"
        for rejects, (index, row) in enumerate(builtin_candidates(self._task, self._seed, i)):
            if rejects > _MAX_REJECTS:
                break
            if row[self._encoder.prompt_key] in self._held_out:
                continue
            datum = self._encoder.encode(row, index, source)
            if datum is not None:
                return datum
            self.num_filtered += 1
            if self.num_filtered == 1:
                warnings.warn(f"data.on_long_prompt=filter: skipping prompts of {source} "
                              f"longer than {self._encoder.limit} tokens", stacklevel=2)
        raise ValueError(f"data.max_input_seq_length: {_MAX_REJECTS} candidate prompts for train "
                         f"item {i} of {source} were all held out or too long")


def chat_template_used(data_cfg: Mapping, tokenizer) -> bool:
    """Whether ``data.use_chat_template`` (auto | true | false) applies the chat template."""
    mode = data_cfg.get("use_chat_template", "auto")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "auto":
        return has_template
    if mode is True and not has_template:
        raise ValueError(
            f"data.use_chat_template: true, but the tokenizer {_tokenizer_name(tokenizer)} has "
            f"no chat_template; use a chat model's tokenizer or set data.use_chat_template: auto"
        )
    if mode not in (True, False):
        raise ValueError(f"data.use_chat_template: {mode!r} is not one of auto, true, false")
    return mode


def format_prompt(text: str, data_cfg: Mapping, tokenizer) -> str:
    """Apply ``data.prompt_template`` and, when used, the tokenizer's chat template."""
    template = data_cfg.get("prompt_template") or "{prompt}"
    _check_template(template)
    content = template.format(prompt=text)
    system = data_cfg.get("system_prompt")
    if not chat_template_used(data_cfg, tokenizer):
        if system:
            # Dropping it silently would train on prompts the user did not ask for.
            raise ValueError(
                f"data.system_prompt is set but no chat template is applied (tokenizer "
                f"{_tokenizer_name(tokenizer)}, data.use_chat_template: "
                f"{data_cfg.get('use_chat_template', 'auto')}); put the text in "
                f"data.prompt_template instead"
            )
        return content
    messages = ([{"role": "system", "content": system}] if system else [])
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
        raise ValueError(f"data.prompt_template: {template!r} is not a valid str.format "
                         f"template ({e}); write literal braces as {{{{ and }}}}") from None
    if fields != {"prompt"}:
        raise ValueError(f"data.prompt_template: {template!r} must use the field {{prompt}} "
                         f"and no other (found {sorted(fields)}); write literal braces as "
                         f"{{{{ and }}}}")


def _tokenizer_name(tokenizer) -> str:
    path = getattr(tokenizer, "name_or_path", "") or "<unnamed>"
    return f"{type(tokenizer).__name__}({path!r})"


class _Encoder:
    """Turns one text row into a ``PromptDatum`` under the ``data`` config (or drops it)."""

    def __init__(self, data_cfg: Mapping, tokenizer):
        self.prompt_key = data_cfg.get("prompt_key") or "prompt"
        self.answer_key = data_cfg.get("answer_key")
        self.limit = int(data_cfg["max_input_seq_length"])
        self.filter = data_cfg.get("on_long_prompt", "error") == "filter"
        if data_cfg.get("on_long_prompt", "error") not in ("error", "filter"):
            raise ValueError(f"data.on_long_prompt: {data_cfg['on_long_prompt']!r} is not "
                             f"one of error, filter")
        if self.limit < 1:
            raise ValueError(f"data.max_input_seq_length: {self.limit} must be positive")
        format_prompt("", data_cfg, tokenizer)  # surfaces template / chat-template errors now
        self._cfg, self._tokenizer = data_cfg, tokenizer
        self._chat = chat_template_used(data_cfg, tokenizer)

    def check_columns(self, row: Mapping, source: str) -> None:
        """The configured prompt / answer columns must exist (checked on the first row)."""
        for key, column in (("prompt_key", self.prompt_key), ("answer_key", self.answer_key)):
            if column is not None and column not in row:
                raise ValueError(f"data.{key}: column {column!r} is not in {source}; "
                                 f"available columns: {sorted(row)}")

    def encode(self, row: Mapping, index: int, source: str) -> PromptDatum | None:
        """The row as a datum, or None when it is too long and ``on_long_prompt`` is filter."""
        text = row.get(self.prompt_key)
        if not isinstance(text, str):
            raise ValueError(f"data.prompt_key: row {index} of {source} has {type(text).__name__}"
                             f" in column {self.prompt_key!r}, not text")
        prompt = format_prompt(text, self._cfg, self._tokenizer)
        ids = tokenize_prompt(prompt, self._tokenizer, self._chat)
        if len(ids) > self.limit:
            if self.filter:
                return None
            raise ValueError(
                f"data.max_input_seq_length: row {index} of {source} is {len(ids)} tokens, over "
                f"the limit of {self.limit}; raise data.max_input_seq_length or set "
                f"data.on_long_prompt: filter to drop such rows")
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        metadata.update(ground_truth=self._answer(row, index, source), index=index,
                        raw_prompt=text)
        return PromptDatum(prompt=prompt, input_ids=tuple(ids), metadata=metadata)

    def _answer(self, row: Mapping, index: int, source: str) -> str | None:
        if self.answer_key is None:
            return None
        if row.get(self.answer_key) is None:  # a reward against "None" would be silently wrong
            raise ValueError(f"data.answer_key: row {index} of {source} has no value in "
                             f"column {self.answer_key!r}")
        return str(row[self.answer_key])

    def encode_all(self, rows: list[Mapping], source: str) -> ListPromptDataset:
        """Encode every row up front; apply ``on_long_prompt``; reject empty results."""
        if not rows:
            raise ValueError(f"{source} has no rows")
        self.check_columns(rows[0], source)
        items = [d for i, r in enumerate(rows) if (d := self.encode(r, i, source)) is not None]
        dropped = len(rows) - len(items)
        if dropped:
            warnings.warn(f"data.on_long_prompt=filter: dropped {dropped} of {len(rows)} prompts "
                          f"of {source} longer than {self.limit} tokens", stacklevel=3)
        if not items:
            raise ValueError(f"data.max_input_seq_length: all {len(rows)} prompts of {source} are "
                             f"longer than {self.limit} tokens and were filtered out")
        return ListPromptDataset(items, num_filtered=dropped)


def build_prompt_datasets(
    master_cfg: Mapping, tokenizer, *, num_val: int, seed: int
) -> tuple[PromptDataset, PromptDataset]:
    """The (train, validation) prompt datasets of a run, from ``master_cfg["data"]``.

    Built-in task: validation = ``num_val`` distinct problems of seed ``seed + 1``; train =
    an infinite stream of seed ``seed`` that never shows a validation prompt.  File / hub
    source: validation from ``data.val_dataset_name`` / ``data.val_split`` (its first
    ``num_val`` prompts) when given, else ``num_val`` rows held out of the train rows by a
    permutation drawn with ``seed``.
    """
    data_cfg = master_cfg["data"]
    encoder = _Encoder(data_cfg, tokenizer)
    name, val_name = data_cfg["dataset_name"], data_cfg.get("val_dataset_name")
    env_cfg = (master_cfg.get("env") or {}).get("arithmetic")
    if is_builtin(name) and data_cfg.get("val_split") is not None:
        raise ValueError(f"data.val_split: the built-in task {name!r} has no splits; set it "
                         f"to null (validation is drawn with seed + 1)")
    if is_builtin(name) and val_name in (None, name):
        return _builtin_datasets(name, env_cfg, encoder, num_val, seed)
    if is_builtin(name):
        task = builtin_task(name, env_cfg)
        train = GeneratedPromptDataset(task, seed, encoder, frozenset(), name)
    else:
        rows = load_rows(name, data_cfg.get("dataset_config"), data_cfg.get("split", "train"))
        train = encoder.encode_all(rows, f"dataset {name!r}")
    if val_name is None and data_cfg.get("val_split") is None:
        return _hold_out(train, num_val, seed, name)
    train[0]  # a built-in train stream: surface a too-long prompt now, not at step 1
    return train, _separate_val(data_cfg, env_cfg, encoder, num_val, seed)


def _builtin_datasets(name, env_cfg, encoder, num_val, seed):
    """Held-out validation problems (seed + 1) and the infinite train stream that avoids them."""
    task = builtin_task(name, env_cfg)
    space_fn = getattr(task, "num_distinct_problems", None)
    space = space_fn() if space_fn is not None else None
    if space is not None and space < 2 * num_val:
        raise ValueError(
            f"grpo.max_val_samples: {num_val} held-out validation prompts need a problem space of "
            f"at least {2 * num_val} distinct prompts to leave as many for training, but "
            f"env.{name} has {space}; lower grpo.max_val_samples or widen env.{name}")
    val, held_out = _builtin_val(task, name, encoder, num_val, seed + 1)
    train = GeneratedPromptDataset(task, seed, encoder, held_out, name)
    train[0]  # surface a too-long prompt (on_long_prompt: error) before training starts
    return train, val


def _builtin_val(task, name, encoder, num_val, seed):
    """``num_val`` distinct problems of ``seed`` (indices 0, 1, ... skipping duplicates)."""
    source = f"built-in task {name!r} validation (seed {seed})"
    items, seen, filtered, index = [], set(), 0, 0
    encoder.check_columns(problem_row(task.problem(seed, 0)), source)
    while len(items) < num_val:
        if index - len(items) > _MAX_REJECTS:
            raise ValueError(f"data.max_input_seq_length: could not draw {num_val} distinct "
                             f"prompts that fit from {source}: {index} tried, {len(items)} kept")
        row = problem_row(task.problem(seed, index))
        if row[encoder.prompt_key] not in seen:
            seen.add(row[encoder.prompt_key])
            datum = encoder.encode(row, index, source)
            filtered += datum is None
            items += [datum] if datum is not None else []
        index += 1
    if filtered:
        warnings.warn(f"data.on_long_prompt=filter: dropped {filtered} prompts of {source} "
                      f"longer than {encoder.limit} tokens", stacklevel=3)
    return ListPromptDataset(items, num_filtered=filtered), frozenset(seen)


def _hold_out(train: ListPromptDataset, num_val: int, seed: int, name: str):
    """Split ``num_val`` prompts off ``train`` by a seeded permutation (sorted source order)."""
    n = train.size
    if n < num_val + 1:
        raise ValueError(f"grpo.max_val_samples: dataset {name!r} has {n} usable prompts, fewer "
                         f"than the {num_val} held out for validation + 1 for training; lower "
                         f"grpo.max_val_samples or set data.val_dataset_name / data.val_split")
    val_pos = set(np.random.default_rng(seed).permutation(n)[:num_val].tolist())
    val = [train._get(i) for i in sorted(val_pos)]
    rest = [train._get(i) for i in range(n) if i not in val_pos]
    return (ListPromptDataset(rest, num_filtered=train.num_filtered),
            ListPromptDataset(val))


def _separate_val(data_cfg, env_cfg, encoder, num_val, seed) -> PromptDataset:
    """Validation from its own source: the first ``num_val`` prompts of it."""
    val_name = data_cfg.get("val_dataset_name") or data_cfg["dataset_name"]
    if is_builtin(val_name):
        return _builtin_val(builtin_task(val_name, env_cfg), val_name, encoder, num_val,
                            seed + 1)[0]
    key = "data.val_dataset_name" if data_cfg.get("val_dataset_name") else "data.val_split"
    split = data_cfg.get("val_split") or data_cfg.get("split", "train")
    # dataset_config applies to both: the config has no separate key for the val source.
    rows = load_rows(val_name, data_cfg.get("dataset_config"), split, key_path=key)
    val = encoder.encode_all(rows, f"validation dataset {val_name!r} (split {split!r})")
    return ListPromptDataset([val._get(i) for i in range(min(num_val, val.size))],
                             num_filtered=val.num_filtered)
