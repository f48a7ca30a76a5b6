"""The ``eager_torch`` plug-in as an installed package would declare it: a ``*.dist-info``
whose ``entry_points.txt`` names the spec in group ``dualrl.backends``.

:func:`write_site` makes such a directory; putting it on ``sys.path`` (this process) or
``PYTHONPATH`` (subprocesses, Ray workers) is what ``pip install`` of a plug-in would do.
Nothing in the repository's packages refers to it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from core.policy import registry
from tests.plugin_backend.spec import NAME

DIST = "dualrl_eager_plugin-0.1.dist-info"
#: Set in a test session started with the plug-in installed (tests/backends adds its layout row).
PLUGIN_SESSION_ENV = "DUALRL_TEST_PLUGIN_SESSION"


def write_site(root: Path) -> Path:
    """``root`` holding the plug-in's dist-info (module and spec stay in tests/plugin_backend)."""
    info = root / DIST
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dualrl-eager-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{NAME} = tests.plugin_backend.spec:SPEC\n")
    return root


@functools.cache
def session_site() -> Path:
    """This test session's site (removed at exit): what a subprocess puts on ``PYTHONPATH`` to
    run with the plug-in installed (its Ray workers inherit it); this process sees the plug-in
    only inside :func:`installed`."""
    site = write_site(Path(tempfile.mkdtemp(prefix="dualrl-test-plugin-")))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    return site


def subprocess_env(site: Path) -> dict[str, str]:
    """This process's environment with the repository and ``site`` on ``PYTHONPATH``."""
    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(repo), str(site))), PLUGIN_SESSION_ENV: "1"}


@contextlib.contextmanager
def installed(site: Path | None = None) -> Iterator[None]:
    """The plug-in visible to this process's registry within the block, forgotten after it
    (other tests enumerate the backends)."""
    path = str(session_site() if site is None else site)
    sys.path.insert(0, path)
    registry._entry_points.cache_clear()
    try:
        yield
    finally:
        sys.path.remove(path)
        registry._entry_points.cache_clear()
        registry._LOADED.pop(NAME, None)
