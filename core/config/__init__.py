"""dualrl's config machinery: typed sections, one validator, YAML files and overrides.

The sections themselves live next to their owners (``core.policy.config``,
``core.losses.config``, ``core.algorithms.config`` for the run configs, ...); this package
holds what they share: :class:`ConfigModel` and :func:`validate` (:mod:`core.config.base`),
and the YAML loader with ``defaults:`` inheritance, dotted overrides and the provenance of
every value (:mod:`core.config.loader`).  It imports nothing else of the project, and
neither torch, jax nor ray.
"""

from core.config.base import ConfigError, ConfigModel, Problem, join_path, problems, validate
from core.config.loader import (
    DEFAULT_CONFIG_PATH,
    EMBEDDED_CONFIGS,
    Provenance,
    apply_overrides,
    deep_merge,
    load_config,
    load_raw_config,
    load_with_provenance,
    load_yaml,
    parse_override,
)

__all__ = [
    "ConfigError",
    "ConfigModel",
    "Problem",
    "join_path",
    "problems",
    "validate",
    "DEFAULT_CONFIG_PATH",
    "EMBEDDED_CONFIGS",
    "Provenance",
    "apply_overrides",
    "deep_merge",
    "load_config",
    "load_raw_config",
    "load_with_provenance",
    "load_yaml",
    "parse_override",
]
