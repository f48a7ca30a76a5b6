"""A run's worker processes write their output to ``<logger.log_dir>/workers.log``
(``core.distributed.worker_output``): the hook, run in a plain subprocess as Ray's
``worker_process_setup_hook`` would run it, and how ``init_ray`` installs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import ray

from core.distributed import ray_init
from core.distributed.worker_output import WORKER_LOG_ENV, worker_log_runtime_env

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import os, sys, warnings
    from core.distributed.worker_output import redirect_worker_output

    redirect_worker_output()
    print("library chatter on stdout")
    print("C-level chatter on stderr", file=sys.stderr)
    os.system("echo a child process")
    warnings.warn_explicit("a library's FutureWarning", FutureWarning, "/site-packages/lib/x.py", 1)
    warnings.warn_explicit("the project's own note", UserWarning, os.path.join({root!r}, "core", "x.py"), 7)
    """
)


def test_the_hook_sends_everything_to_the_file_and_forwards_only_the_projects_warnings(tmp_path):
    log = tmp_path / "logs" / "workers.log"
    env = worker_log_runtime_env(log)["env_vars"]  # also creates logs/
    out = subprocess.run(
        [sys.executable, "-c", WORKER.format(root=str(REPO))],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = log.read_text()
    for line in ("--- worker process", "library chatter", "C-level chatter", "a child process", "FutureWarning"):
        assert line in text, text
    assert "the project's own note" in text
    # The console (what Ray forwards to the driver) keeps only the project's warning.
    assert out.stdout == ""
    assert "the project's own note" in out.stderr and "core/x.py:7" in out.stderr
    assert "chatter" not in out.stderr and "FutureWarning" not in out.stderr


def test_a_file_that_cannot_be_opened_leaves_the_output_where_it_was(tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    out = subprocess.run(
        [sys.executable, "-c", WORKER.format(root=str(REPO))],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", WORKER_LOG_ENV: str(blocked / "workers.log")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "worker output stays on the console: cannot open" in out.stderr
    assert "library chatter on stdout" in out.stdout


def test_init_ray_installs_the_hook_only_when_asked(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_init, "_start_reaper", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_init.init_ray(num_cpus=1)
    ray_init.init_ray(num_cpus=1, worker_log=tmp_path / "run" / "workers.log")
    assert "runtime_env" not in calls[0]
    runtime_env = calls[1]["runtime_env"]
    assert runtime_env["worker_process_setup_hook"] == "core.distributed.worker_output.redirect_worker_output"
    assert runtime_env["env_vars"] == {WORKER_LOG_ENV: str(tmp_path / "run" / "workers.log")}
    assert calls[1]["log_to_driver"] is True  # errors and the project's warnings still reach the console
