"""Typed configs: pydantic v2 models that speak dualrl's error messages.

Every config section is a :class:`ConfigModel` that lives next to the code that owns it
(``core.policy.config.PolicyConfig``, ``core.losses.config.ClippedPGLossConfig``, ...):
its fields, their types, defaults and docstrings are the one description of the section.
Code reads attributes (``cfg.policy.parallel.tensor_parallel_size``); a default lives
in the class and nowhere else.

Why pydantic rather than frozen dataclasses: the sections need strict scalar types (a bool is
not an int), unknown keys refused, nested sections, ranges and every error collected at once
with its path -- pydantic does all of that from the annotations, where dataclasses would need
the 770-line hand-written walker this replaced.  NeMo RL, whose key names dualrl mirrors,
uses pydantic for its configs too, and vLLM already depends on it (no new dependency).

:func:`validate` is the one entry point.  It reports every problem of a config at once, one
line each, starting with the dotted path of the field (``policy.parallel.tensor_parallel_size:
...``), in three passes:

1. :meth:`ConfigModel.refusals`: keys present in the input that this kind of config does not
   use (a GRPO key in an SFT run), named as such and left out of what follows;
2. the types (pydantic), with dualrl's wording and a "did you mean" for unknown keys;
3. :meth:`ConfigModel.check`: the rules a type cannot say (divisibility, cross-field rules),
   for every section that is well typed.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["ConfigError", "ConfigModel", "Problem", "validate", "join_path"]

#: ``(dotted path relative to the section, message)``; an empty path means the section itself.
Problem = tuple[str, str]
M = TypeVar("M", bound="ConfigModel")


class ConfigError(ValueError):
    """An invalid configuration.  ``errors`` holds one message per problem; ``str()`` of
    the exception is those messages, one per line (each starting with a dotted path)."""

    def __init__(self, errors: str | Sequence[str]):
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


class ConfigModel(BaseModel):
    """A config section: strict types, unknown keys refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True)

    #: What a section is called in messages about a missing key ("key" / "section").
    missing_what: ClassVar[str] = "key"

    def check(self) -> Iterable[Problem]:
        """The rules between this section's fields that a type cannot say.  Sub-sections
        check themselves; a section checks what needs its own fields (or its children's)."""
        return ()

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        """Keys of the raw input this kind of config refuses with a message of its own (they
        are dropped before the type check, so what lies below them is not reported too)."""
        return ()

    @classmethod
    def extra_sections(cls) -> dict[str, type[ConfigModel]]:
        """Sections this model accepts besides its fields (a section whose keys are known only at
        run time, such as a plug-in backend's block): their errors get the same hints."""
        return {}

    @classmethod
    def missing_message(cls, key: str) -> str:
        return f"missing required {cls.missing_what}"

    @classmethod
    def coerce(cls, value: Any, path: str = "") -> Self:
        """``value`` if it already is one, else the validated section (:func:`validate`)."""
        return value if isinstance(value, cls) else validate(cls, value, path)

    def to_dict(self) -> dict[str, Any]:
        """The section as plain YAML-ready data (defaults filled in)."""
        return self.model_dump(mode="python")


def validate(cls: type[M], raw: Any, path: str = "") -> M:
    """``raw`` (a mapping, e.g. loaded YAML) as a ``cls``; :class:`ConfigError` listing every
    problem otherwise.  ``path`` prefixes every message (``"policy"`` for a policy section)."""
    refused = list(cls.refusals(raw)) if isinstance(raw, Mapping) else []
    data = _without(raw, [p for p, _ in refused]) if refused else raw
    lines = [_line(path, p, msg) for p, msg in refused]
    try:
        model = cls.model_validate(data)
    except ValidationError as err:
        lines += [_error_line(cls, e, path) for e in err.errors()]
        lines += _checks_of_valid_sections(cls, data, err, path)
        raise ConfigError(lines) from None
    lines += [_line(path, p, msg) for p, msg in problems(model)]
    if lines:
        raise ConfigError(lines)
    return model


def problems(model: ConfigModel, path: str = "") -> Iterator[Problem]:
    """Every :meth:`ConfigModel.check` problem of ``model`` and its sub-sections, with
    paths relative to ``model``."""
    for name in type(model).model_fields:
        for key, child in _children(getattr(model, name), name):
            for p, msg in problems(child):
                yield join_path(key, p), msg
    for p, msg in model.check():
        yield p, msg


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not key:
        return path
    if not path:
        return key
    return f"{path}{key}" if key.startswith("[") else f"{path}.{key}"


# ----------------------------------------------------------------------------- internals
def _children(value: Any, key: str) -> Iterator[tuple[str, ConfigModel]]:
    if isinstance(value, ConfigModel):
        yield key, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, ConfigModel):
                yield f"{key}[{i}]", item


def _checks_of_valid_sections(cls: type[ConfigModel], data: Any, err: ValidationError, path: str) -> list[str]:
    """What :meth:`ConfigModel.check` says of the parts of a config whose types are right, so
    that one run of ``dualrl config`` lists as much as it can.  Unknown keys (typos) are left
    out first: a config whose only type errors are unknown keys gets all its checks; otherwise
    each top-level section whose types are right gets its own."""
    errors = err.errors()
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    data = _without_locs(data, unknown)
    if len(unknown) == len(errors):
        return _problem_lines(cls, data, path)
    broken = {e["loc"][0] for e in errors if e["loc"] and e["type"] != "extra_forbidden"}
    lines = []
    for name, field in cls.model_fields.items():
        section = _model_class(field.annotation)
        if name not in broken and section is not None and isinstance(data, Mapping) and name in data:
            lines += _problem_lines(section, data[name], join_path(path, name))
    return lines


def _problem_lines(cls: type[ConfigModel], data: Any, path: str) -> list[str]:
    try:
        model = cls.model_validate(data)
    except ValidationError:  # a type error the caller has reported
        return []
    return [_line(path, p, msg) for p, msg in problems(model)]


def _without_locs(data: Any, locs: Iterable[Sequence[Any]]) -> Any:
    """A copy of ``data`` (nested mappings and lists) without the entries at ``locs``."""
    out = copy.deepcopy(data)
    for loc in locs:
        node = out
        for key in loc[:-1]:
            node = node[key] if isinstance(node, (Mapping, list)) else None
        if isinstance(node, dict):
            node.pop(loc[-1], None)
    return out


def _without(raw: Mapping[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """A copy of ``raw`` without the (dotted) ``paths``."""
    out = dict(raw)
    for dotted in paths:
        keys, node = dotted.split("."), out
        for key in keys[:-1]:
            if not isinstance(node.get(key), Mapping):
                break
            node[key] = dict(node[key])
            node = node[key]
        else:
            node.pop(keys[-1], None)
    return out


def _line(path: str, field: str, message: str) -> str:
    return f"{join_path(path, field) or '<config>'}: {message}"


_TYPE_NAMES = {
    "int_type": "int",
    "float_type": "float",
    "bool_type": "bool",
    "string_type": "str",
    "list_type": "a list",
    "dict_type": "a mapping",
    "none_required": "None",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _error_line(root: type[ConfigModel], error: Mapping[str, Any], path: str) -> str:
    """One pydantic error in dualrl's words: ``dotted.path: what is wrong``."""
    loc, kind, value, ctx = error["loc"], error["type"], error.get("input"), error.get("ctx") or {}
    where = join_path(path, _dotted(loc)) or "<config>"
    owner = _model_at(root, loc[:-1])
    if kind == "missing":
        key = str(loc[-1])
        return f"{where}: {owner.missing_message(key) if owner else 'missing required key'}"
    if kind == "extra_forbidden":
        return f"{where}: unknown key ({_hint(str(loc[-1]), owner)})"
    if kind == "literal_error":
        return f"{where}: expected one of {ctx['expected'].replace(' or ', ', ')}, got {value!r}"
    if kind in _TYPE_NAMES:
        return f"{where}: expected {_TYPE_NAMES[kind]}, got {_got(value)}"
    if kind in ("model_type", "model_attributes_type"):
        name = ctx.get("class_name") or (owner.__name__ if owner else "a section")
        return f"{where}: expected a mapping ({name}), got {_got(value)}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"{where}: must be {_BOUNDS[kind]} {bound}, got {value!r}"
    if kind in ("value_error", "assertion_error"):
        return f"{where}: {ctx.get('error', error['msg'])}"
    return f"{where}: {error['msg']}, got {_got(value)}"


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for key in loc:
        out = join_path(out, key if isinstance(key, int) else str(key))
    return out


def _hint(key: str, owner: type[ConfigModel] | None) -> str:
    if owner is None:
        return "not a known key"
    known = [*owner.model_fields, *owner.extra_sections()]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else "known keys: " + ", ".join(known)


def _model_at(root: type[ConfigModel], loc: Sequence[Any]) -> type[ConfigModel] | None:
    """The section class at ``loc`` below ``root`` (None when it is not a section)."""
    tp: Any = root
    for key in loc:
        tp = _strip_optional(tp)
        if isinstance(key, int):
            args = get_args(tp)
            tp = args[0] if get_origin(tp) is list and args else None
        elif isinstance(tp, type) and issubclass(tp, BaseModel) and key in tp.model_fields:
            tp = tp.model_fields[key].annotation
        elif isinstance(tp, type) and issubclass(tp, ConfigModel) and key in tp.extra_sections():
            tp = tp.extra_sections()[key]
        else:
            return None
    return _model_class(tp)


def _model_class(tp: Any) -> type[ConfigModel] | None:
    tp = _strip_optional(tp)
    return tp if isinstance(tp, type) and issubclass(tp, ConfigModel) else None


def _strip_optional(tp: Any) -> Any:
    """``X | None`` / ``Annotated[X, ...]`` -> ``X``."""
    while True:
        origin = get_origin(tp)
        if origin is typing.Annotated:
            tp = get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [m for m in get_args(tp) if m is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _short(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _got(value: Any) -> str:
    return "None" if value is None else f"{type(value).__name__} ({_short(value)})"
