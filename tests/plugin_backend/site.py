"""The ``eager_torch`` plug-in as an installed package would declare it: a ``*.dist-info``
whose ``entry_points.txt`` names the spec in group ``dualrl.backends``.

:func:`write_site` makes such a directory; putting it on ``sys.path`` (this process) or
``PYTHONPATH`` (subprocesses, Ray workers) is what ``pip install`` of a plug-in would do.
Nothing in the repository's packages refers to it.
"""

from __future__ import annotations

import contextlib
import sys
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
    (info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\n{NAME} = tests.plugin_backend.spec:SPEC\n"
    )
    return root


@contextlib.contextmanager
def installed(site: Path) -> Iterator[None]:
    """The plug-in visible to this process's registry within the block, forgotten after it
    (other tests enumerate the backends)."""
    sys.path.insert(0, str(site))
    registry._entry_points.cache_clear()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        registry._entry_points.cache_clear()
        registry._LOADED.pop(NAME, None)
