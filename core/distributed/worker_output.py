"""A run's worker processes write their stdout/stderr to one file in the run's log directory.

vLLM engines and the libraries under the policy workers print start-up chatter (Triton, NUMA
binding, FutureWarnings) that Ray forwards to the driver's console, between the progress
bar's lines.  ``init_ray(worker_log=PATH)`` (the training commands pass
``<logger.log_dir>/workers.log``) installs :func:`redirect_worker_output` as Ray's
``worker_process_setup_hook``.

Why this way: the hook runs in every worker process of the job once, before any actor is
built or its module imported, so one line covers the policy workers, the engines (and the
processes vLLM forks: they inherit the descriptors) and the reward actors, from their first
output on; redirecting file descriptors 1 and 2, not only ``sys.stdout``, also catches C++
and child-process output.  ``ray.init(log_to_driver=False)`` alone would leave the output in
one file per process under Ray's session directory (``/tmp/ray/session_*/logs``), not with
the run; redirecting in each actor's constructor would miss what its imports print.

What stays on the console: errors travel as exceptions, so the driver still reports a failed
worker with its rank and cause (``core.distributed.worker_group``,
``core.generation.engine_health``); the ``dualrl`` loggers' warnings (:mod:`core.reporting`)
and warnings raised from a file of ``core/``, ``backends/``, ``benchmarks/`` or ``dualrl/`` also
go to the process's original stderr, which Ray forwards to the driver.  The ``dualrl`` loggers'
INFO lines (what a worker chose: its mesh's device order, where its weights went) go to the
file only.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from core.reporting import ROOT_LOGGER

__all__ = [
    "WORKER_LOG_ENV",
    "WORKER_LOG_FILENAME",
    "current_worker_log",
    "redirect_worker_output",
    "worker_log_runtime_env",
]

#: The log file's path, as the worker processes see it (set through the job's runtime_env).
WORKER_LOG_ENV = "DUALRL_WORKER_LOG"
#: Its name in a run's ``logger.log_dir``.
WORKER_LOG_FILENAME = "workers.log"

_HOOK = f"{__name__}.redirect_worker_output"
_ROOT = Path(__file__).resolve().parents[2]
_PROJECT_DIRS = tuple(str(_ROOT / name) + os.sep for name in ("core", "backends", "benchmarks", "dualrl"))


def worker_log_runtime_env(path: str | os.PathLike) -> dict[str, Any]:
    """The job-level ``runtime_env`` that sends every worker's output to ``path`` (absolute:
    the workers run in another directory).  Ray merges its ``env_vars`` with an actor's own."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return {"worker_process_setup_hook": _HOOK, "env_vars": {WORKER_LOG_ENV: str(path)}}


def current_worker_log() -> str | None:
    """The file this driver's Ray job sends its workers' output to; None: the console (Ray not
    started, or started without ``worker_log``, e.g. by a test session)."""
    import ray

    if not ray.is_initialized():
        return None
    env = ray.get_runtime_context().runtime_env or {}
    return (env.get("env_vars") or {}).get(WORKER_LOG_ENV)


def redirect_worker_output() -> None:
    """Point this process's descriptors 1 and 2 at the file named by ``$DUALRL_WORKER_LOG``
    (appending: several processes and a resumed run share it).  Never raises: a worker whose
    file cannot be opened keeps printing where it did, with one line saying why."""
    path = os.environ.get(WORKER_LOG_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as err:
        print(f"dualrl: worker output stays on the console: cannot open {path}: {err}", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1)  # Ray forwards this file to the driver
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"--- worker process {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')} ---", flush=True)
    show = warnings.showwarning

    def show_and_forward(message, category, filename, lineno, file=None, line=None):
        show(message, category, filename, lineno, file, line)
        if file is None and os.path.abspath(filename).startswith(_PROJECT_DIRS):
            console.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show_and_forward
    _route_project_logs(console)


def _route_project_logs(console: Any) -> None:
    """The ``dualrl`` loggers in a redirected worker: INFO and above to the log file (fd 2
    now), warnings and errors to the console too."""
    root = logging.getLogger(ROOT_LOGGER)
    root.setLevel(logging.INFO)
    root.propagate = False  # these two handlers are the whole story: no copy through a library's root handler
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    for stream, level in ((sys.stderr, logging.INFO), (console, logging.WARNING)):
        handler = logging.StreamHandler(stream)
        handler.setLevel(level)
        handler.setFormatter(formatter)
        root.addHandler(handler)
