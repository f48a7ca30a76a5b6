"""The one place that maps ``policy.backend`` to a :class:`~core.policy.backend_spec.BackendSpec`.

Backends register by package entry point, group ``dualrl.backends``: ``NAME = module:SPEC``,
where ``module.SPEC`` is the backend's spec object.  The built-in backends are declared that
way in the repository's ``pyproject.toml``, exactly as an outside package declares its own;
core names none of them.  An installed distribution's metadata can predate its source tree (an
editable install made before the table changed), so the table is also read from the
``pyproject.toml`` of the checkout core itself was imported from; the installed metadata wins
where both name a backend.  :func:`register_backend` adds a spec at run time (a notebook, a
test).

Names are listed from the entry points alone (the CLI's ``--backend`` choices import nothing);
a spec module is imported on its first lookup.  A spec that cannot be imported is reported when
it is asked for by name, and does not stop the other backends from validating.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from core.policy.backend_spec import BackendSpec

#: The entry point group backends register in.
ENTRY_POINT_GROUP = "dualrl.backends"

_REGISTERED: dict[str, BackendSpec] = {}
_LOADED: dict[str, BackendSpec] = {}


class BackendNotFound(ValueError):
    """``policy.backend`` names no registered backend, or its spec cannot be loaded."""


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) the backend ``spec.name``, ahead of any entry point of that name."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"register_backend expects a BackendSpec, got {type(spec).__name__}")
    _REGISTERED[spec.name] = spec


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend` (entry points stay)."""
    _REGISTERED.pop(name, None)


def backend_names() -> list[str]:
    """Every backend name, declared by an entry point (in declaration order: the built-ins as
    pyproject.toml lists them, then installed plug-ins) or registered; no spec is imported."""
    return list(dict.fromkeys([*_entry_points(), *_REGISTERED]))


def backend_spec(name: str) -> BackendSpec:
    """The spec of backend ``name``; :class:`BackendNotFound` naming the known ones otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _LOADED:
        return _LOADED[name]
    points = _entry_points()
    if name not in points:
        _entry_points.cache_clear()  # a plug-in may have been installed since the last look
        points = _entry_points()
    if name not in points:
        raise BackendNotFound(f"{name!r} is not a registered backend; known: {backend_names()}")
    _LOADED[name] = _load(name, points[name])
    return _LOADED[name]


def all_specs() -> list[BackendSpec]:
    """The specs of every backend that loads (one that does not is reported by name when asked for)."""
    specs = []
    for name in backend_names():
        try:
            specs.append(backend_spec(name))
        except BackendNotFound:
            continue
    return specs


def _load(name: str, target: str) -> BackendSpec:
    where = f"entry point {name} = {target} (group {ENTRY_POINT_GROUP})"
    module_name, _, attr = target.partition(":")
    try:
        spec = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise BackendNotFound(f"backend {name!r}: cannot load its spec, {where}: {err}") from err
    if not isinstance(spec, BackendSpec) or spec.name != name:
        raise BackendNotFound(f"backend {name!r}: {where} is not the BackendSpec named {name!r}, got {spec!r}")
    return spec


@functools.cache
def _entry_points() -> dict[str, str]:
    """``{name: "module:attr"}`` of the group: the checkout's table, then the installed ones."""
    points = dict(_checkout_entry_points())
    points.update({ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})
    return points


def _checkout_entry_points() -> dict[str, str]:
    """The group as the ``pyproject.toml`` beside ``core/`` declares it (a source checkout)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    if project.get("name") != "dualrl":
        return {}
    table = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return {str(k): str(v) for k, v in table.items()}
