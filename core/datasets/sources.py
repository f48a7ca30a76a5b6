"""Where prompt rows come from: local files, the Hugging Face hub, or a built-in task.

Every source ends up as a list of plain ``dict`` rows (file and hub sources) or as a pure
function ``index -> row`` (built-in generated tasks).  Prompt sets are small, so file and
hub datasets are materialised in memory; nothing here knows about tokenizers.

``datasets`` (and the built-in task modules) are imported inside the functions that use
them so that ``import core.datasets`` stays cheap and backend-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.environments.config import ArithmeticTaskConfig, ReasoningGymConfig

#: The built-in sources whose problems are the arithmetic task's (knobs: env.arithmetic /
#: data.arithmetic).
ARITHMETIC_SOURCES = ("arithmetic", "arithmetic-preferences", "tool-arithmetic")
#: Every built-in source: the arithmetic ones and reasoning-gym's tasks (data.reasoning_gym).
BUILTIN_SOURCES = (*ARITHMETIC_SOURCES, "reasoning_gym")

# File suffixes we hand to a packaged ``datasets`` builder (``load_dataset("json", ...)``).
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# A hub id is ``name`` or ``org/name`` (one slash at most, no leading dot or slash).  On
# POSIX ``os.sep`` is "/", so "contains a separator" alone cannot tell "openai/gsm8k" from
# a relative path; anything that is not a hub id, or ends in a data-file suffix, is a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")

# Offsets between the candidate problems tried for one train item of a built-in task:
# a large prime keeps the candidate chains of different items from overlapping early.
CANDIDATE_STRIDE = 1_000_000_007


class DatasetLoadError(RuntimeError):
    """A file or hub dataset could not be read; the message names the source and config key."""


def is_builtin(name: str) -> bool:
    """True for the names of built-in generated tasks (``BUILTIN_SOURCES``)."""
    return name in BUILTIN_SOURCES


def is_arithmetic_source(name: str) -> bool:
    """True for the built-in sources made of arithmetic problems (``ARITHMETIC_SOURCES``)."""
    return name in ARITHMETIC_SOURCES


def looks_like_path(name: str) -> bool:
    """True when ``name`` is meant as a local path rather than a hub dataset id."""
    if os.path.splitext(name)[1].lower() in _FILE_BUILDERS:
        return True
    if os.sep != "/" and os.sep in name:
        return True
    return name.startswith((".", "/", "~")) or not _HUB_ID.match(name)


def load_rows(
    name: str, config: str | None, split: str, *, key_path: str = "data.dataset_name"
) -> list[dict[str, Any]]:
    """Read every row of a local file / directory or a hub dataset as plain dicts.

    ``.jsonl`` / ``.json`` / ``.parquet`` files load through ``datasets``' packaged
    builders (a single file has one split, ``train``; asking it for another is an error);
    an existing directory or loading script, and any hub name, through
    ``load_dataset(name, config, split=split)``.  Errors name ``name`` and ``key_path``.
    """
    path = os.path.expanduser(name)
    suffix = os.path.splitext(path)[1].lower()
    args: tuple[str | None, ...]
    kwargs: dict[str, str]
    if os.path.exists(path):
        if os.path.isfile(path) and suffix in _FILE_BUILDERS:
            if split != "train":  # else a val_split would silently re-read the train file
                raise ValueError(
                    f"{key_path}: {path!r} is a single file, whose only split is 'train' (asked "
                    f"for {split!r}); use data.val_dataset_name for a separate validation file"
                )
            _check_not_empty(path, suffix, key_path)
            args, kwargs = (_FILE_BUILDERS[suffix],), {"data_files": path, "split": "train"}
        else:
            args, kwargs = (path, config), {"split": split}
        what = f"local dataset {path!r}"
    elif looks_like_path(name):
        raise FileNotFoundError(
            f"{key_path}: dataset file {path!r} does not exist (relative to {os.getcwd()!r}); "
            f"give an existing .jsonl/.json/.parquet file or directory, a hub dataset id "
            f"('org/name'), or one of the built-in tasks {BUILTIN_SOURCES}"
        )
    else:
        args, kwargs = (name, config), {"split": split}
        what = f"hub dataset {name!r} (config {config!r}, split {split!r})"
    return _load(args, kwargs, what, key_path)


def _load(args: tuple, kwargs: dict, what: str, key_path: str) -> list[dict[str, Any]]:
    """Call ``datasets.load_dataset`` and turn any failure into one readable error."""
    import datasets  # lazy: keeps ``import core.datasets`` free of the datasets stack

    try:
        ds = datasets.load_dataset(*args, keep_in_memory=True, **kwargs)
    except Exception as e:  # noqa: BLE001 -- datasets raises many types; all mean "cannot load"
        # DatasetGenerationError's own text is generic; the useful part is its cause.
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        raise DatasetLoadError(f"{key_path}: could not load {what}: {type(e).__name__}: {e}{cause}") from e
    if isinstance(ds, Mapping):  # a DatasetDict: split=None or a script ignoring split
        raise DatasetLoadError(f"{key_path}: {what} has splits {sorted(ds)}; name one")
    return ds.to_list()


def _check_not_empty(path: str, suffix: str, key_path: str) -> None:
    """Reject an empty file up front: ``datasets`` reports one only as an obscure error."""
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: pyarrow comes with datasets

        empty = pq.read_metadata(path).num_rows == 0
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            empty = not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), ""))
    if empty:
        raise ValueError(f"{key_path}: dataset file {path!r} is empty (no rows)")


def builtin_task(
    name: str,
    task_cfg: ArithmeticTaskConfig | Mapping[str, Any] | None,
    path: str = "env.arithmetic",
    tool_demo_fraction: float | None = None,
    reasoning_gym: ReasoningGymConfig | None = None,
):
    """The task object behind a built-in source: ``ArithmeticTask`` for "arithmetic" (rows:
    prompt, answer), wrapped in ``PreferenceTask`` for "arithmetic-preferences" (rows: prompt,
    chosen, rejected, answer) or in ``ToolDemoTask`` for "tool-arithmetic" (rows: prompt,
    answer, messages: a direct answer or, for a share ``tool_demo_fraction``, a calculator-call
    demonstration); ``ReasoningGymTask`` of ``reasoning_gym`` (``data.reasoning_gym``) for
    "reasoning_gym" (rows: prompt, answer and the task's columns).  ``path`` is where the
    arithmetic knobs live in the config."""
    if name == "reasoning_gym":
        from core.environments.reasoning_gym import ReasoningGymTask  # lazy: sibling package

        if reasoning_gym is None:  # DataConfig.check refuses it
            raise ValueError("data.reasoning_gym: required with data.dataset_name: reasoning_gym (its tasks)")
        return ReasoningGymTask(reasoning_gym)
    if name in BUILTIN_SOURCES:
        from core.environments.arithmetic import ArithmeticTask  # lazy: sibling package

        task = ArithmeticTask(task_cfg, path=path)
        if name == "tool-arithmetic":
            from core.environments.tools.demos import ToolDemoTask

            return ToolDemoTask(task, tool_demo_fraction)
        return PreferenceTask(task) if name == "arithmetic-preferences" else task
    raise ValueError(f"data.dataset_name: {name!r} is not a built-in task {BUILTIN_SOURCES}")


class PreferenceTask:
    """A task's problems as preference pairs: chosen = the right answer, rejected = a wrong
    one a learner plausibly gives (off by one or two, or by ten: a carry slip), drawn from
    ``(seed, index)`` so the pair is as reproducible as the problem."""

    _SLIPS = (-10, -2, -1, 1, 2, 10)

    def __init__(self, task):
        self.task = task

    def problem(self, seed: int, index: int) -> dict[str, str]:
        import numpy as np

        row = dict(self.task.problem(seed, index))
        answer = int(row["answer"])
        slips = [d for d in self._SLIPS if self.task.allow_negative or answer + d >= 0]
        slip = slips[int(np.random.default_rng([seed, index, 2]).integers(len(slips)))]
        row.update(chosen=str(answer), rejected=str(answer + slip))
        return row

    def problems(self, seed: int, start: int, count: int) -> list[dict[str, str]]:
        return [self.problem(seed, i) for i in range(start, start + count)]

    def num_distinct_problems(self) -> int:
        return self.task.num_distinct_problems()


def builtin_rows(name: str, env_arithmetic_cfg: Mapping | None, seed: int, start: int, count: int) -> list[dict]:
    """Problems ``start .. start+count-1`` of a built-in task for ``seed``, as rows."""
    task = builtin_task(name, env_arithmetic_cfg)
    return [problem_row(p) for p in task.problems(seed, start, count)]


def builtin_candidates(task, seed: int, index: int) -> Iterator[tuple[int, dict]]:
    """The problems that may stand as train item ``index``, in the order to try them.

    Candidate k is problem ``index + k * CANDIDATE_STRIDE``: the first one not rejected
    (held out for validation, or filtered as too long) is the item.  A pure function of
    ``(seed, index)``, so a resumed run sees exactly the same stream.
    """
    k = 0
    while True:
        source_index = index + k * CANDIDATE_STRIDE
        yield source_index, problem_row(task.problem(seed, source_index))
        k += 1


def problem_row(problem: Mapping) -> dict:
    """A task problem as a plain text row (tasks may carry extra fields; keep them)."""
    row = dict(problem)
    row["prompt"], row["answer"] = str(problem["prompt"]), str(problem["answer"])
    return row
