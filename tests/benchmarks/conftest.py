"""Fixtures the benchmark tests share: the CLI in this process or in a child, no TRL row, and the
XLA host devices of the test session's Ray actors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The repository root: where ``python -m dualrl`` finds this checkout's packages.
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli():
    """``dualrl ...`` in this process (its Ray is the test session's, when one runs); the exit code."""
    from dualrl.cli import main

    return main


@pytest.fixture
def run_cli():
    """``python -m dualrl ...`` in a process of its own (its own Ray); the completed process."""

    def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "dualrl", *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def no_trl(monkeypatch):
    """``dualrl bench`` without its TRL row (CI installs no ``bench`` extra; test_trl_grpo.py runs TRL)."""
    from benchmarks.lib import trl_grpo

    monkeypatch.setattr(trl_grpo, "trl_version", lambda: None)


@pytest.fixture
def actor_devices(ray_session) -> int:
    """The XLA host devices a JAX actor of the test session's Ray sees (8: tests/conftest.py)."""
    from benchmarks.lib.ray_session import actor_device_count

    return actor_device_count()
