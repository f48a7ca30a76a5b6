"""reasoning-gym, the optional package, as the config checks see it: is it installed, does a
task of that name exist, are its settings its own and does its generator accept them.

A leaf of the environments package (it imports none of its modules): the ``env`` and ``data``
sections call it from their checks, before any worker starts, and
:mod:`core.environments.reasoning_gym` builds its tasks through it.  reasoning-gym is imported
only when a function here is called.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any, Protocol

from core.config import Problem

#: What installs the optional package (the version the project is tested with).
INSTALL_COMMAND = "pip install 'dualrl[reasoning]'  (or: pip install reasoning-gym==0.1.25)"
#: Settings of a reasoning-gym config that a task entry here sets otherwise (refused by the entry).
RESERVED_SETTINGS = ("seed", "size")


class TaskEntry(Protocol):
    """A task of ``data.reasoning_gym.tasks`` (core.environments.config.ReasoningGymTaskConfig)."""

    name: str
    seed: int
    settings: dict[str, Any]


def import_reasoning_gym() -> ModuleType:
    """The package (ImportError when it is not installed)."""
    import reasoning_gym  # lazy: an optional extra, and slow to import

    return reasoning_gym


def missing_package() -> str | None:
    """Why reasoning-gym cannot be used here (with the command that installs it), or None."""
    try:
        import_reasoning_gym()
    except ImportError as err:
        return (
            f"'reasoning_gym' needs the optional package reasoning-gym, which cannot be imported "
            f"({type(err).__name__}: {err}); install it with: {INSTALL_COMMAND}"
        )
    return None


def registry() -> Mapping[str, tuple[type, type]]:
    """reasoning-gym's task name -> (dataset class, config dataclass)."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return DATASETS


def dataset(name: str, seed: int, settings: Mapping[str, Any]) -> Any:
    """The task's generator (its config validated by reasoning-gym)."""
    return import_reasoning_gym().create_dataset(name, seed=seed, **dict(settings))


def task_problems(tasks: Iterable[TaskEntry]) -> Iterable[Problem]:
    """Each task's name, settings and first problem checked against reasoning-gym itself
    (paths relative to ``data.reasoning_gym``).  Without the package nothing is checked here:
    the source that names it (``data.dataset_name``) is refused with the install command."""
    if missing_package():
        return
    known = registry()
    for i, task in enumerate(tasks):
        yield from ((f"tasks[{i}].{key}", message) for key, message in _one_task_problems(task, known))


def _one_task_problems(task: TaskEntry, known: Mapping[str, tuple[type, type]]) -> Iterable[Problem]:
    if task.name not in known:
        close = difflib.get_close_matches(task.name, list(known), n=3, cutoff=0.6)
        listing = f"did you mean {' or '.join(map(repr, close))}?" if close else f"tasks: {', '.join(sorted(known))}"
        yield "name", f"{task.name!r} is not a reasoning-gym task; {listing}"
        return
    fields = {f.name for f in dataclasses.fields(known[task.name][1])}
    unknown = sorted(set(task.settings) - fields - set(RESERVED_SETTINGS))
    for key in unknown:
        settings = ", ".join(sorted(fields - set(RESERVED_SETTINGS)))
        yield f"settings.{key}", f"not a setting of {task.name} (its settings: {settings})"
    if unknown or set(task.settings) & set(RESERVED_SETTINGS):  # the entry's own check names those
        return
    try:
        dataset(task.name, task.seed, task.settings)[0]
    except Exception as err:  # noqa: BLE001 -- a task's own validation raises anything (mostly AssertionError)
        yield "settings", f"{task.settings!r} rejected by reasoning-gym's {task.name}: {type(err).__name__}: {err}"
