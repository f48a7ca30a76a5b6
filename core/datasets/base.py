"""Datasets of encoded examples and the train / validation split every algorithm shares.

An *encoder* turns one text row into a datum (a GRPO prompt, an SFT sequence, a DPO pair)
or drops it; this module does the rest the same way for all of them: read the source (a
built-in task, a local file, a hub dataset), encode the rows, and split off validation --
held-out problems of a built-in task, a separate source, or rows held out by a seeded
permutation.  An encoder provides::

    prompt_key: str            # the column that identifies an example (held-out check)
    limit: int                 # its length limit in tokens
    limit_key: str             # the config key of that limit (named in errors)
    drop_note: str             # what drops a too-long row, e.g. "data.on_long_prompt=filter"
    check_columns(row, source) # raise naming the missing column
    encode(row, index, source) # -> datum (a dataclass with ``metadata``) or None (dropped)
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from core.datasets.config import DataConfig
from core.datasets.sources import builtin_candidates, builtin_task, is_builtin, load_rows, problem_row
from core.environments.config import ArithmeticTaskConfig
from core.reporting import get_logger

logger = get_logger(__name__)

# How many candidate problems a built-in item / the validation draw may reject (held out,
# duplicate, too long) before we conclude the configuration cannot produce examples.
_MAX_REJECTS = 1000


class EncodedDataset(abc.ABC):
    """Random access to encoded examples; finite (``size`` = count) or infinite (``size`` None)."""

    size: int | None = None
    num_filtered: int = 0  # rows dropped by the encoder (too long, nothing left to train on)

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError("infinite dataset has no len(); check .size (None)")
        return self.size

    def __bool__(self) -> bool:  # without this, bool() would call __len__ and raise
        return self.size is None or self.size > 0

    def __getitem__(self, i: int) -> Any:
        if self.size is not None and i < 0:
            i += self.size
        if i < 0 or (self.size is not None and i >= self.size):
            raise IndexError(f"example index {i} out of range (size {self.size})")
        datum = self._get(int(i))
        # A fresh metadata dict per access: callers may annotate it without changing the data.
        return dataclasses.replace(datum, metadata=dict(datum.metadata))

    @abc.abstractmethod
    def _get(self, i: int) -> Any:
        """Item ``i`` (already range-checked)."""


class ListDataset(EncodedDataset):
    """A finite dataset whose examples were all encoded up front."""

    def __init__(self, items: list[Any], num_filtered: int = 0):
        self._items = list(items)
        self.size = len(self._items)
        self.num_filtered = num_filtered

    def _get(self, i: int) -> Any:
        return self._items[i]


class GeneratedDataset(EncodedDataset):
    """The infinite train stream of a built-in task: item i is a pure function of (seed, i).

    Item i is the first of ``builtin_candidates(task, seed, i)`` whose prompt is not held
    out and that the encoder keeps (it drops rows that do not fit its length limit).
    """

    def __init__(self, task, seed: int, encoder, held_out: frozenset[str], name: str):
        self._task, self._seed, self._encoder = task, seed, encoder
        self._held_out, self._name = held_out, name
        self.size = None
        encoder.check_columns(problem_row(task.problem(seed, 0)), f"built-in task {name!r}")
        # Bounded cache: the stream is infinite, but the loop re-reads recent items.
        self._cached = functools.lru_cache(maxsize=8192)(self._generate)

    def _get(self, i: int) -> Any:
        return self._cached(i)

    def _generate(self, i: int) -> Any:
        source = f"built-in task {self._name!r} (seed {self._seed})"
        for rejects, (index, row) in enumerate(builtin_candidates(self._task, self._seed, i)):
            if rejects > _MAX_REJECTS:
                break
            # Built-in rows always carry the prompt text (a conversation column is no set key).
            if row["prompt"] in self._held_out:
                continue
            datum = self._encoder.encode(row, index, source)
            if datum is not None:
                return datum
            self.num_filtered += 1
            if self.num_filtered == 1:
                logger.warning(
                    "%s: skipping examples of %s that do not fit %s tokens",
                    self._encoder.drop_note,
                    source,
                    self._encoder.limit,
                )
        raise ValueError(
            f"{self._encoder.limit_key}: {_MAX_REJECTS} candidate examples for train "
            f"item {i} of {source} were all held out or too long"
        )


def encode_rows(encoder, rows: Sequence[Mapping[str, Any]], source: str) -> ListDataset:
    """Encode every row up front; report dropped rows; reject an empty result."""
    if not rows:
        raise ValueError(f"{source} has no rows")
    encoder.check_columns(rows[0], source)
    items = [d for i, r in enumerate(rows) if (d := encoder.encode(r, i, source)) is not None]
    dropped = len(rows) - len(items)
    if dropped:
        logger.warning(
            "%s: dropped %d of %d rows of %s that do not fit %s tokens",
            encoder.drop_note,
            dropped,
            len(rows),
            source,
            encoder.limit,
        )
    if not items:
        raise ValueError(
            f"{encoder.limit_key}: all {len(rows)} rows of {source} are longer than "
            f"{encoder.limit} tokens and were dropped ({encoder.drop_note})"
        )
    return ListDataset(items, num_filtered=dropped)


def build_datasets(
    data_cfg: DataConfig,
    task_cfg: ArithmeticTaskConfig | None,
    encoder,
    *,
    num_val: int,
    seed: int,
    num_val_key: str,
    exclude: frozenset[str] = frozenset(),
    task_path: str = "env.arithmetic",
) -> tuple[EncodedDataset, EncodedDataset]:
    """The (train, validation) datasets of a run from its ``data`` section and an encoder.

    Built-in task: validation = ``num_val`` distinct problems of seed ``data.val_seed``
    (null: ``seed + 1``); train = an infinite stream of seed ``seed`` that never shows a
    validation prompt nor one of ``exclude`` (prompts another stage holds out).  File / hub
    source: validation from ``data.val_dataset_name`` / ``data.val_split`` (its first
    ``num_val`` examples) when given, else ``num_val`` rows held out of the train rows by a
    permutation drawn with ``data.val_seed`` (null: ``seed``).  ``num_val_key`` is the config
    key that sets ``num_val`` and ``task_path`` the one holding the built-in task's knobs
    ``task_cfg`` (both named in errors).
    """
    task = functools.partial(
        builtin_task, task_cfg=task_cfg, path=task_path, tool_demo_fraction=data_cfg.tool_demo_fraction
    )
    name, val_name = data_cfg.dataset_name, data_cfg.val_dataset_name
    if is_builtin(name) and data_cfg.val_split is not None:
        raise ValueError(
            f"data.val_split: the built-in task {name!r} has no splits; set it "
            f"to null (validation is drawn with data.val_seed)"
        )
    val_seed = builtin_val_seed(data_cfg, seed)
    if is_builtin(name) and val_name in (None, name):
        return _builtin_datasets(task(name), name, encoder, num_val, seed, val_seed, num_val_key, exclude)
    train: EncodedDataset
    if is_builtin(name):  # with its own validation source (the case above returned)
        train = GeneratedDataset(task(name), seed, encoder, exclude, name)
    else:
        rows = load_rows(name, data_cfg.dataset_config, data_cfg.split)
        listed = encode_rows(encoder, rows, f"dataset {name!r}")
        if val_name is None and data_cfg.val_split is None:
            hold_out_seed = seed if data_cfg.val_seed is None else data_cfg.val_seed
            return _hold_out(listed, num_val, hold_out_seed, name, num_val_key)
        train = listed
    train[0]  # a built-in train stream: surface a too-long example now, not at step 1
    return train, _separate_val(data_cfg, task, encoder, num_val, val_seed)


def builtin_val_seed(data_cfg: DataConfig, seed: int) -> int:
    """The seed of a built-in task's held-out problems in a run seeded ``seed``."""
    return seed + 1 if data_cfg.val_seed is None else data_cfg.val_seed


def build_eval_dataset(
    data_cfg: DataConfig,
    task_cfg: ArithmeticTaskConfig | None,
    encoder,
    name: str,
    split: str | None,
    *,
    num_builtin: int,
    seed: int,
    key_path: str,
    task_path: str = "env.arithmetic",
) -> EncodedDataset:
    """The examples of ``name`` alone, to evaluate on (no train source is read): a built-in
    task's held-out problems -- the ``num_builtin`` a run seeded ``seed`` (and ``data.val_seed``)
    validates on -- or
    every row of a file / hub dataset's ``split`` (None: ``data.split``).  ``key_path`` is
    what errors name."""
    if is_builtin(name):
        if split is not None:
            raise ValueError(f"{key_path}: the built-in task {name!r} has no splits (asked for {split!r})")
        return _builtin_val(
            builtin_task(name, task_cfg, task_path, data_cfg.tool_demo_fraction),
            name,
            encoder,
            num_builtin,
            builtin_val_seed(data_cfg, seed),
        )[0]
    split = split or data_cfg.split
    rows = load_rows(name, data_cfg.dataset_config, split, key_path=key_path)
    return encode_rows(encoder, rows, f"dataset {name!r} (split {split!r})")


def _builtin_datasets(task, name, encoder, num_val, seed, val_seed, num_val_key, exclude):
    """Held-out validation problems (``val_seed``) and the infinite train stream (``seed``) that avoids them."""
    space_fn = getattr(task, "num_distinct_problems", None)
    space = space_fn() if space_fn is not None else None
    if space is not None and space < 2 * num_val:
        raise ValueError(
            f"{num_val_key}: {num_val} held-out validation prompts need a problem space of "
            f"at least {2 * num_val} distinct prompts to leave as many for training, but "
            f"the built-in task {name!r} has {space}; lower {num_val_key} or widen the task"
        )
    val, held_out = _builtin_val(task, name, encoder, num_val, val_seed)
    train = GeneratedDataset(task, seed, encoder, held_out | exclude, name)
    train[0]  # surface a too-long example (error mode) before training starts
    return train, val


def _builtin_val(task, name, encoder, num_val, seed):
    """``num_val`` distinct problems of ``seed`` (indices 0, 1, ... skipping duplicates)."""
    source = f"built-in task {name!r} validation (seed {seed})"
    items, seen, filtered, index = [], set(), 0, 0
    encoder.check_columns(problem_row(task.problem(seed, 0)), source)
    while len(items) < num_val:
        if index - len(items) > _MAX_REJECTS:
            raise ValueError(
                f"{encoder.limit_key}: could not draw {num_val} distinct "
                f"examples that fit from {source}: {index} tried, {len(items)} kept"
            )
        row = problem_row(task.problem(seed, index))
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            datum = encoder.encode(row, index, source)
            filtered += datum is None
            items += [datum] if datum is not None else []
        index += 1
    if filtered:
        logger.warning(
            "%s: dropped %d examples of %s that do not fit %s tokens",
            encoder.drop_note,
            filtered,
            source,
            encoder.limit,
        )
    return ListDataset(items, num_filtered=filtered), frozenset(seen)


def _hold_out(train: ListDataset, num_val: int, seed: int, name: str, num_val_key: str):
    """Split ``num_val`` examples off ``train`` by a seeded permutation (sorted source order)."""
    n = len(train)
    if n < num_val + 1:
        raise ValueError(
            f"{num_val_key}: dataset {name!r} has {n} usable rows, fewer "
            f"than the {num_val} held out for validation + 1 for training; lower "
            f"{num_val_key} or set data.val_dataset_name / data.val_split"
        )
    val_pos = set(np.random.default_rng(seed).permutation(n)[:num_val].tolist())
    val = [train._get(i) for i in sorted(val_pos)]
    rest = [train._get(i) for i in range(n) if i not in val_pos]
    return ListDataset(rest, num_filtered=train.num_filtered), ListDataset(val)


def _separate_val(data_cfg, task, encoder, num_val, val_seed) -> EncodedDataset:
    """Validation from its own source (``task``: name -> built-in task): its first ``num_val`` examples."""
    val_name = data_cfg.val_dataset_name or data_cfg.dataset_name
    if is_builtin(val_name):
        return _builtin_val(task(val_name), val_name, encoder, num_val, val_seed)[0]
    key = "data.val_dataset_name" if data_cfg.val_dataset_name else "data.val_split"
    split = data_cfg.val_split or data_cfg.split
    # dataset_config applies to both: the config has no separate key for the val source.
    rows = load_rows(val_name, data_cfg.dataset_config, split, key_path=key)
    val = encode_rows(encoder, rows, f"validation dataset {val_name!r} (split {split!r})")
    return ListDataset([val._get(i) for i in range(min(num_val, val.size))], num_filtered=val.num_filtered)
