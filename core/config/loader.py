"""Loading configs: YAML files with ``defaults:`` inheritance, and ``a.b.c=value`` overrides.

A YAML file may start with ``defaults: base.yaml`` (or a list of files): those files are
loaded first (paths relative to the including file, recursively) and deep-merged, then
the file itself is merged on top -- the child wins; mappings merge key by key, anything
else (lists included) is replaced.  A cycle of ``defaults`` is a :class:`ConfigError`.

Overrides use YAML for values (``2`` -> int, ``true`` -> bool, ``null`` -> None,
``[1,2]`` -> list, ``'2'`` -> str); unlike plain PyYAML, scientific notation without a
dot (``1e-6``) is read as a float, in files as well as in overrides.

PyYAML is imported on first use, so importing :mod:`core.config` stays cheap.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from core.config.schema import MasterConfig
from core.config.validate import ConfigError, validate_master_config

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "load_yaml",
    "deep_merge",
    "parse_override",
    "apply_overrides",
    "load_config",
]

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
    return _load(Path(path).resolve(), ())


def _load(path: Path, stack: tuple[Path, ...]) -> dict[str, Any]:
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
        raise ConfigError(
            f"<config>: the top level of {path} must be a mapping, got {type(data).__name__}"
        )
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(
            f"defaults: expected a file name or a list of file names in {path}, got {defaults!r}"
        )
    merged: dict[str, Any] = {}
    for name in defaults:
        parent = (path.parent / name).resolve()
        if not parent.is_file():
            raise ConfigError(f"defaults: file {name!r} not found (looked for {parent}, from {path})")
        merged = deep_merge(merged, _load(parent, (*stack, path)))
    return deep_merge(merged, data)


# ----------------------------------------------------------------------------- overrides
def parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    """``"policy.train_micro_batch_size=2"`` -> ``(("policy", "train_micro_batch_size"), 2)``.

    The value is read as YAML (see the module docstring); an empty value is ``None``.
    """
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(
            f"override {override!r}: expected KEY=VALUE, e.g. policy.train_micro_batch_size=2"
        )
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
    if isinstance(overrides, str):
        overrides = [overrides]
    out = copy.deepcopy(dict(cfg))
    for ov in overrides:
        if isinstance(ov, str):
            keys, value = parse_override(ov)
            label = ov
        else:
            raw_keys, value = ov
            keys = tuple(raw_keys.split(".")) if isinstance(raw_keys, str) else tuple(raw_keys)
            label = f"{'.'.join(keys)}={value!r}"
            if not keys or any(not isinstance(k, str) or not k for k in keys):
                raise ConfigError(f"override {label!r}: invalid key {raw_keys!r}")
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
    return out


def load_config(
    path: str | Path,
    overrides: Iterable[str] = (),
    backend: str | None = None,
) -> MasterConfig:
    """Load ``path``, apply ``overrides`` then ``backend`` (sets ``policy.backend``, what
    the CLI's ``--backend`` does), validate the whole config and return it."""
    cfg = load_yaml(path)
    cfg = apply_overrides(cfg, overrides)
    if backend is not None:
        cfg = apply_overrides(cfg, [(("policy", "backend"), backend)])
    return validate_master_config(cfg)
