"""The backends' own blocks in the ``policy`` section, and their old spellings.

A backend whose spec has a ``config_key`` owns ``policy.<config_key>``, a
block validated by the spec's model wherever it appears -- a config that runs on several
backends keeps each one's block, and ``--backend`` picks which is read.  The section's own
model (:class:`core.policy.config.PolicyConfig`) knows no backend: its validator hands every
key that is a registered backend's block to that backend's model (:func:`split_blocks`), so
a typo inside a block is reported at its full path like any other.

An option several backends have is spelled once (:mod:`core.policy.options`); each spec lists
the spellings it had before (``renamed``), which are refused naming the one key
(:func:`renamed_key_problems`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails

from core.config import ConfigModel, Problem
from core.policy.registry import all_specs


def block_models() -> dict[str, type[ConfigModel]]:
    """``{config_key: block model}`` of every registered backend that has a block."""
    return {s.config_key: s.config_block for s in all_specs() if s.config_key and s.config_block}


def renamed_keys() -> dict[str, str]:
    """Every backend's old spelling (dotted below ``policy``) -> the one key that replaced it."""
    return {old: new for spec in all_specs() for old, new in spec.renamed.items()}


def renamed_key_problems(raw: Mapping[str, Any]) -> Iterable[Problem]:
    """A problem for each old spelling present in a raw ``policy`` mapping, naming the new key."""
    for old, new in renamed_keys().items():
        if _present(raw, old.split(".")):
            yield old, f"renamed: use policy.{new} (one key on every backend; docs/configuration.md)"


def _present(raw: Any, keys: list[str]) -> bool:
    for key in keys:
        if not isinstance(raw, Mapping) or key not in raw:
            return False
        raw = raw[key]
    return True


def split_blocks(
    data: Mapping[str, Any], fields: Iterable[str], default_key: str | None
) -> tuple[dict[str, Any], dict[str, ConfigModel], list[InitErrorDetails]]:
    """``(the section's own keys, the validated blocks, errors)`` of a raw ``policy`` mapping:
    keys that are neither ``fields`` nor a backend's block are unknown keys (pydantic's
    ``extra_forbidden``, so they get the usual "did you mean"); ``default_key``'s block (the
    chosen backend's) is filled with its defaults when absent."""
    models, own = block_models(), set(fields)
    rest: dict[str, Any] = {}
    blocks: dict[str, ConfigModel] = {}
    errors: list[InitErrorDetails] = []
    for key, value in data.items():
        if key in own:
            rest[key] = value
        elif key in models:
            try:
                blocks[key] = value if isinstance(value, models[key]) else models[key].model_validate(value)
            except ValidationError as err:
                errors += [_nested(key, e) for e in err.errors()]
        else:
            errors.append(InitErrorDetails(type="extra_forbidden", loc=(key,), input=value))
    if default_key is not None and default_key in models and default_key not in data:
        blocks[default_key] = models[default_key]()
    return rest, blocks, errors


def _nested(key: str, error: Any) -> InitErrorDetails:
    """A block's validation error, located below the block's key."""
    detail = InitErrorDetails(type=error["type"], loc=(key, *error["loc"]), input=error.get("input"))
    if error.get("ctx"):
        detail["ctx"] = error["ctx"]
    return detail


def errors_of(err: ValidationError) -> list[InitErrorDetails]:
    """``err``'s line errors, to raise again with others."""
    return [_nested_root(e) for e in err.errors()]


def _nested_root(error: Any) -> InitErrorDetails:
    detail = InitErrorDetails(type=error["type"], loc=tuple(error["loc"]), input=error.get("input"))
    if error.get("ctx"):
        detail["ctx"] = error["ctx"]
    return detail
