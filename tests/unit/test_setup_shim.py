"""The ``setup.py`` shim next to ``pyproject.toml`` (the design card names one): it defers to
pyproject, and the distribution still builds and installs through it -- from a copy of the
sources, so nothing is written into the checkout or the shared environment."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What pyproject.toml's packages.find includes (and the README it reads).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "core", "backends", "benchmarks", "dualrl")


def test_setup_py_is_a_shim_that_defers_to_pyproject():
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert [ast.unparse(c.func) for c in calls] == ["setup"]
    assert not calls[0].args and not calls[0].keywords  # every setting stays in pyproject.toml


def _copy_sources(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _pip(*args: str, cwd: Path) -> None:
    # Offline and into no environment: the venv's own setuptools builds, dependencies are not resolved.
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_distribution_builds_and_installs_through_the_shim(tmp_path):
    src = _copy_sources(tmp_path / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), ".", cwd=src)
    (wheel,) = (tmp_path / "dist").glob("dualrl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "Name: dualrl" in zf.read(meta).decode()
        assert "dualrl = dualrl.cli:main" in zf.read(entry_points).decode()
    for package in ("core/__init__.py", "backends/__init__.py", "benchmarks/__init__.py", "dualrl/cli.py"):
        assert package in names
    assert "core/configs/default.yaml" in names  # package data

    target = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=tmp_path)
    assert (target / "bin" / "dualrl").is_file()
    probe = "import dualrl.cli, core, backends, benchmarks; print(dualrl.cli.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(target))
