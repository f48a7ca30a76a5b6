"""What the config tests share: the shipped files, the error helpers, the section classes."""

from __future__ import annotations

import typing
from pathlib import Path
from types import UnionType
from typing import Any

import pytest

from core.algorithms.config import MasterConfig, run_config_class
from core.config import (
    DEFAULT_CONFIG_PATH,
    EMBEDDED_CONFIGS,
    ConfigError,
    ConfigModel,
    join_path,
    load_config,
    load_raw_config,
    validate,
)
from core.policy.config import PolicyConfig

REPO = Path(__file__).resolve().parents[3]
CONFIG_DIR = DEFAULT_CONFIG_PATH.parent
SHIPPED_YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))
GRPO, SFT, DPO = EMBEDDED_CONFIGS["grpo"], EMBEDDED_CONFIGS["sft"], EMBEDDED_CONFIGS["dpo"]
#: The built-in backends (pyproject.toml's dualrl.backends entry points).
BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")


def errors_of(raw: Any, schema: type[ConfigModel] = MasterConfig, path: str = "") -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(schema, raw, path)
    return info.value.errors


def load_errors(path: Path, *overrides: str, backend: str | None = None, schema=None) -> list[str]:
    schema = schema or run_config_class(load_raw_config(path, overrides, backend))
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), backend=backend, schema=schema)
    return info.value.errors


def layout_errors(policy: Any, world_size: int) -> list[str]:
    """``PolicyConfig.layout_problems`` as the run config words them (``policy.`` prefixed)."""
    return [
        f"{join_path('policy', p)}: {m}" for p, m in PolicyConfig.coerce(policy, "policy").layout_problems(world_size)
    ]


def config_models() -> list[type[ConfigModel]]:
    import core.algorithms.config  # noqa: F401 - imports every section module
    from core.policy.registry import all_specs

    all_specs()  # the built-in backends' blocks (their spec modules)
    out, todo = set(), list(ConfigModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith(("core.", "backends.")) and cls not in out:
            out.add(cls)
            todo.extend(cls.__subclasses__())
    return sorted(out, key=lambda c: (c.__module__, c.__name__))


def section_class(annotation: Any) -> type[ConfigModel] | None:
    """The section class of a field (``X``, ``X | None``, ``list[X]``), else None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, UnionType, list):
        inner = [section_class(a) for a in typing.get_args(annotation)]
        inner = [c for c in inner if c is not None]
        return inner[0] if len(inner) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, ConfigModel) else None
