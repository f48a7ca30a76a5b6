"""Core names no backend: the built-in backends' names may appear only where they are registered.

    python tools/backend_names.py --check   # exit 1, one line per hit (make lint runs it)

The names are read from the built-in backends' specs (the ``dualrl.backends`` entry points of
pyproject.toml), so a renamed or added backend is covered without editing this file: each
spec's ``name`` (``torch_fsdp``), its worker class (``FSDP1PolicyWorker``), its config block
(``dtensor_cfg``) and its layout names (``fsdp1-dp2``), plus the engines' labels (``FSDP1``,
``DTensor...``, ``Jax...`` identifiers).

Where they may appear: ``backends/`` (the registrations and the backends themselves),
``tests/``, ``docs/``, the YAML configs (which set a backend), ``pyproject.toml`` (the entry
points) and the benchmarks' layout tables and recipes (``benchmarks/`` but its layout grammar).
Where they may not, in code or comments: ``core/`` (the library: it asks a backend's spec
instead of branching on its name), ``dualrl/`` (the CLI) and ``benchmarks/lib/layouts.py``
(which learns the layouts from the specs).  One exception by kind: ``core/kernels/`` is array
code written for torch tensors and jax arrays, where ``DTensor`` is torch's tensor type and
``JaxOps`` the jax-array operations -- the engine labels are allowed there, the backends'
names are not.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: What is checked: every Python file below these (paths relative to the repository).
CHECKED = ("core", "dualrl", "benchmarks/lib/layouts.py")
#: Array-library code: the engine labels (not the backends' names) are allowed below it.
LABELS_ALLOWED = ("core/kernels",)
#: The engines' labels: FSDP1, and identifiers naming DTensor or Jax things (JaxPolicyWorker).
LABELS = (r"\bFSDP1\w*", r"\bDTensor\w*", r"\bJax[A-Z]\w*")


def builtin_tokens() -> list[str]:
    """Regexes of every built-in backend's name, worker class, block key and layout names."""
    sys.path.insert(0, str(REPO))
    from core.policy.registry import _checkout_entry_points, backend_spec

    tokens = []
    for name in _checkout_entry_points():
        spec = backend_spec(name)
        tokens += [rf"\b{re.escape(spec.name)}\b", rf"\b{re.escape(spec.worker_class_name)}\b"]
        if spec.config_key:
            tokens.append(rf"\b{re.escape(spec.config_key)}\b")
        tokens.append(rf"\b{re.escape(spec.layout_prefix)}-(?:{re.escape(spec.data_axis)}|cp|tp)\d")
    return tokens


def checked_files() -> Iterator[Path]:
    for entry in CHECKED:
        path = REPO / entry
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def hits() -> list[str]:
    """``path:line: token`` for every built-in backend name where none may be."""
    names = re.compile("|".join(builtin_tokens()))
    labels = re.compile("|".join(LABELS))
    found = []
    for path in checked_files():
        rel = path.relative_to(REPO).as_posix()
        labelled = not rel.startswith(LABELS_ALLOWED)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            matches = [*names.finditer(line), *(labels.finditer(line) if labelled else ())]
            for token in dict.fromkeys(m.group(0) for m in matches):
                found.append(f"{rel}:{number}: {token!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a built-in backend is named out of place")
    args = parser.parse_args()
    found = hits()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} built-in backend name(s) outside their registrations (see tools/backend_names.py)")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
