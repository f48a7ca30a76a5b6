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


def write_site(root: Path) -> Path:
    """``root`` holding the plug-in's dist-info (module and spec stay in tests/plugin_backend)."""
    info = root / DIST
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dualrl-eager-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{NAME} = tests.plugin_backend.spec:SPEC\n")
    return root


@functools.cache
def session_site() -> Path:
    """The test session's site (removed at exit), on ``PYTHONPATH`` for every process started
    from now on: called by tests/conftest.py before Ray starts, so its workers see the plug-in.
    This process sees it only inside :func:`installed`."""
    site = write_site(Path(tempfile.mkdtemp(prefix="dualrl-test-plugin-")))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(site)) if p)
    return site


def subprocess_env(site: Path) -> dict[str, str]:
    """This process's environment with the repository and ``site`` on ``PYTHONPATH``."""
    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(repo), str(site)))}


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
