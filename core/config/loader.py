"""Loading configs: YAML files with ``defaults:`` inheritance, and ``a.b.c=value`` overrides.

A YAML file may start with ``defaults: base.yaml`` (or a list of files): those files are
loaded first (paths relative to the including file, recursively) and deep-merged, then
the file itself is merged on top -- the child wins; mappings merge key by key, anything
else (lists included) is replaced.  A cycle of ``defaults`` is a :class:`ConfigError`.

Overrides use YAML for values (``2`` -> int, ``true`` -> bool, ``null`` -> None,
``[1,2]`` -> list, ``'2'`` -> str); unlike plain PyYAML, scientific notation without a
dot (``1e-6``) is read as a float, in files as well as in overrides.

Provenance: :func:`load_config` remembers where every value came from -- the YAML file of
the ``defaults`` chain that set it last, an override, or ``--backend`` -- and each line of a
:class:`ConfigError` it raises ends with that source (``(from override
'policy.generation.temperature=0')``, ``(from core/configs/grpo_arithmetic.yaml)``), so a
reader fixes the value where it was written instead of searching the defaults chain.

PyYAML is imported on first use, so importing :mod:`core.config` stays cheap.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from core.config.base import ConfigError, ConfigModel, validate

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "EMBEDDED_CONFIGS",
    "load_yaml",
    "deep_merge",
    "parse_override",
    "apply_overrides",
    "load_config",
    "load_raw_config",
    "load_with_provenance",
    "Provenance",
]

M = TypeVar("M", bound=ConfigModel)

#: The shipped example config (``core/configs/default.yaml``).
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

#: The embedded default of each ``dualrl`` training command (its config with no ``--config``).
EMBEDDED_CONFIGS = {
    "grpo": DEFAULT_CONFIG_PATH.with_name("grpo_arithmetic.yaml"),
    "sft": DEFAULT_CONFIG_PATH.with_name("sft_arithmetic.yaml"),
    "dpo": DEFAULT_CONFIG_PATH.with_name("dpo_arithmetic.yaml"),
}

# YAML 1.1 floats plus exponent-without-dot forms ("1e-6", "5E3"), which PyYAML's
# resolver otherwise leaves as strings.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


@functools.lru_cache(maxsize=1)
def _yaml():
    import yaml

    class _Loader(yaml.SafeLoader):
        """SafeLoader that also reads ``1e-6`` as a float."""

    _Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
    return yaml, _Loader


def _safe_load(text: str) -> Any:
    yaml, loader = _yaml()
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


# ----------------------------------------------------------------------------- files
def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``override`` merged on top (mappings recursively)."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file, resolving its ``defaults:`` chain; returns a plain dict
    (without the ``defaults`` key)."""
    return _load(Path(path).resolve(), (), Provenance())


def _load(path: Path, stack: tuple[Path, ...], provenance: Provenance) -> dict[str, Any]:
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"defaults: cycle detected: {chain}")
    yaml, _ = _yaml()
    text = path.read_text()  # FileNotFoundError for a missing top-level file
    try:
        data = _safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"<config>: invalid YAML in {path}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<config>: the top level of {path} must be a mapping, got {type(data).__name__}")
    defaults = data.pop("defaults", None)
    if defaults is None:
        provenance.record_file(data, path)
        return data
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"defaults: expected a file name or a list of file names in {path}, got {defaults!r}")
    merged: dict[str, Any] = {}
    for name in defaults:
        parent = (path.parent / name).resolve()
        if not parent.is_file():
            raise ConfigError(f"defaults: file {name!r} not found (looked for {parent}, from {path})")
        merged = deep_merge(merged, _load(parent, (*stack, path), provenance))
    provenance.record_file(data, path)  # after its parents: the child wins
    return deep_merge(merged, data)


# ----------------------------------------------------------------------------- overrides
def parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    """``"policy.train_micro_batch_size=2"`` -> ``(("policy", "train_micro_batch_size"), 2)``.

    The value is read as YAML (see the module docstring); an empty value is ``None``.
    """
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. policy.train_micro_batch_size=2")
    key, raw = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {override!r}: empty key; expected KEY=VALUE")
    keys = tuple(k.strip() for k in key.split("."))
    if any(not k for k in keys):
        raise ConfigError(f"override {override!r}: empty component in key {key!r}")
    yaml, _ = _yaml()
    try:
        value = _safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"override {override!r}: cannot parse value {raw!r} ({problem})") from None
    return keys, value


def apply_overrides(
    cfg: Mapping[str, Any],
    overrides: Iterable[str | tuple[str | Sequence[str], Any]],
) -> dict[str, Any]:
    """A new dict: ``cfg`` with each override set.

    An override is a ``"a.b.c=value"`` string or a ``(keys, value)`` pair (keys a dotted
    string or a sequence).  Missing intermediate mappings (and ``null`` ones) are created;
    descending into any other non-mapping value is a :class:`ConfigError`.  Unknown keys
    are not rejected here -- validation reports them, with a suggestion.
    """
    out = copy.deepcopy(dict(cfg))
    for keys, value, label in _parsed_overrides(overrides):
        _set_override(out, keys, value, label)
    return out


def _parsed_overrides(overrides) -> Iterator[tuple[tuple[str, ...], Any, str]]:
    """``(keys, value, label)`` of every override; the label is how errors quote it."""
    if isinstance(overrides, str):
        overrides = [overrides]
    for ov in overrides:
        if isinstance(ov, str):
            keys, value = parse_override(ov)
            yield keys, value, ov
            continue
        raw_keys, value = ov
        keys = tuple(raw_keys.split(".")) if isinstance(raw_keys, str) else tuple(raw_keys)
        label = f"{'.'.join(map(str, keys))}={value!r}"
        if not keys or any(not isinstance(k, str) or not k for k in keys):
            raise ConfigError(f"override {label!r}: invalid key {raw_keys!r}")
        yield keys, value, label


def _set_override(out: dict[str, Any], keys: tuple[str, ...], value: Any, label: str) -> None:
    node: dict[str, Any] = out
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        elif not isinstance(child, dict):
            where = ".".join(keys[: i + 1])
            raise ConfigError(
                f"{where}: cannot apply override {label!r}: {where} is "
                f"{type(child).__name__} ({child!r}), not a mapping"
            )
        node = child
    node[keys[-1]] = copy.deepcopy(value)


# ----------------------------------------------------------------------------- provenance
class Provenance:
    """Where the values of one loaded config came from, in the order they were applied.

    A YAML file writes every leaf it holds (lists are leaves: a child's list replaces its
    parent's); an override or ``--backend`` writes its key (its value replaces whatever was
    there).  The source of a field is the last write at, above or below its path.
    """

    def __init__(self) -> None:
        self._writes: list[tuple[tuple[str, ...], str]] = []

    def record(self, keys: Sequence[str], source: str) -> None:
        self._writes.append((_field_keys(".".join(keys)), source))

    def record_file(self, data: Mapping[str, Any], path: Path) -> None:
        source = f"from {_display_path(path)}"
        for keys in _leaf_paths(data):
            self.record(keys, source)

    def source_of(self, field: str) -> str | None:
        """``"from override 'a.b=1'"`` / ``"from FILE"`` / ``"from --backend X"`` for a dotted
        field path (``policy.scheduler[2].milestones`` included); None when nothing wrote it."""
        keys = _field_keys(field)
        for written, source in reversed(self._writes):
            n = min(len(written), len(keys))
            if written[:n] == keys[:n]:
                return source
        return None

    def explain(self, err: ConfigError) -> ConfigError:
        """``err`` with each line's source appended (lines without a field path unchanged)."""
        return ConfigError([self._explain_line(line) for line in err.errors])

    def _explain_line(self, line: str) -> str:
        field, sep, _ = line.partition(": ")
        if not sep or " " in field or field.startswith("<"):
            return line
        source = self.source_of(field)
        return line if source is None else f"{line} ({source})"

    @contextlib.contextmanager
    def explaining(self) -> Iterator[None]:
        """Re-raise a :class:`ConfigError` from the block with every line's source."""
        try:
            yield
        except ConfigError as err:
            raise self.explain(err) from None


def _field_keys(field: str) -> tuple[str, ...]:
    """``"policy.scheduler[2].milestones"`` -> ``("policy", "scheduler", "milestones")``: list
    items are not sources of their own (a list is written whole)."""
    return tuple(k for k in re.split(r"\.|(?=\[)", field) if k and not k.startswith("["))


def _leaf_paths(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaf_paths(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key))


def _display_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (as a user typed it)."""
    try:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    except (ValueError, OSError):
        return str(path)


def load_with_provenance(
    path: str | Path,
    overrides: Iterable[str] = (),
    backend: str | None = None,
) -> tuple[dict[str, Any], Provenance]:
    """Load ``path``, apply ``overrides`` then ``backend`` (without validating); returns the
    config and where each of its values came from."""
    provenance = Provenance()
    cfg = _load(Path(path).resolve(), (), provenance)
    for keys, value, label in _parsed_overrides(overrides):
        _set_override(cfg, keys, value, label)
        provenance.record(keys, f"from override {label!r}")
    if backend is not None:  # after the overrides: the flag wins over policy.backend=...
        _set_override(cfg, ("policy", "backend"), backend, f"--backend {backend}")
        provenance.record(("policy", "backend"), f"from --backend {backend}")
    return cfg, provenance


def load_raw_config(path: str | Path, overrides: Iterable[str] = (), backend: str | None = None) -> dict[str, Any]:
    """``path`` with its ``defaults`` chain, ``overrides`` then ``backend`` applied: the plain
    data, not validated (to edit before validating, as the benchmarks and tests do)."""
    return load_with_provenance(path, overrides, backend)[0]


def load_config(
    path: str | Path,
    overrides: Iterable[str] = (),
    backend: str | None = None,
    *,
    schema: type[M],
    checks: Iterable[Callable[[M], list[str]]] = (),
) -> M:
    """Load ``path``, apply ``overrides`` then ``backend`` (sets ``policy.backend``, what the
    CLI's ``--backend`` does) and validate the result as a ``schema``.

    ``checks`` are further ``config -> error lines`` rules run on the valid config (the
    preflight that reads model files and imports classes).  Every line of the
    :class:`ConfigError` raised names where the value at fault came from (see :class:`Provenance`).
    """
    raw, provenance = load_with_provenance(path, overrides, backend)
    with provenance.explaining():
        cfg = validate(schema, raw)
        errors = [line for check in checks for line in check(cfg)]
        if errors:
            raise ConfigError(errors)
    return cfg
