"""One way to report a problem (core.reporting): the ``dualrl`` logger hierarchy, its lines
above an open progress bar, notes said once, and a redirected worker's split between its log
file and the driver's console."""

from __future__ import annotations

import io
import logging

import pytest
from tqdm import tqdm

from core import reporting
from core.distributed import worker_output
from core.reporting import ProgressBarHandler, get_logger, show_logs_above_progress, warn_once


@pytest.fixture
def dualrl_logger():
    """The ``dualrl`` logger's handlers, level and propagation restored after the test."""
    root = logging.getLogger(reporting.ROOT_LOGGER)
    saved = (list(root.handlers), root.level, root.propagate)
    yield root
    root.handlers[:], root.level, root.propagate = saved


def test_every_module_logs_under_dualrl():
    assert get_logger("core.algorithms.grpo").name == "dualrl.core.algorithms.grpo"
    assert get_logger("backends.jax_pjit.sharding").name == "dualrl.backends.jax_pjit.sharding"
    assert get_logger("dualrl.cli").name == "dualrl.cli"  # the CLI package is already under it


def test_lines_go_above_the_progress_bar(dualrl_logger, monkeypatch):
    written: list[str] = []
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, text, file=None, **kw: written.append(text)))
    handler = show_logs_above_progress()
    assert show_logs_above_progress(logging.WARNING) is handler  # installed once; the level moves
    assert [h for h in dualrl_logger.handlers if isinstance(h, ProgressBarHandler)] == [handler]
    show_logs_above_progress(logging.INFO)
    log = get_logger("core.algorithms.training_run")
    log.info("workers up in %.1f s", 2.0)
    log.warning("step %d: skipped", 7)
    log.debug("not shown")
    assert written == ["workers up in 2.0 s", "WARNING step 7: skipped"]


def test_a_note_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(reporting, "_warned", set())
    log = get_logger("core.generation.sampling")
    with caplog.at_level(logging.WARNING, logger="dualrl"):
        for _ in range(3):
            warn_once(log, "greedy logprobs at temperature 1.0")
        warn_once(log, "another note")
    assert [r.getMessage() for r in caplog.records] == ["greedy logprobs at temperature 1.0", "another note"]


def test_a_redirected_worker_logs_info_to_its_file_and_warnings_to_the_console_too(dualrl_logger, monkeypatch):
    file, console = io.StringIO(), io.StringIO()
    monkeypatch.setattr(worker_output.sys, "stderr", file)  # fd 2 is the worker log after the redirect
    worker_output._route_project_logs(console)
    log = get_logger("backends.jax_pjit.sharding")
    log.info("JAX mesh {'fsdp': 8}: jax.make_mesh's device order")
    log.warning("row-major order")
    assert file.getvalue().splitlines() == [
        "INFO dualrl.backends.jax_pjit.sharding: JAX mesh {'fsdp': 8}: jax.make_mesh's device order",
        "WARNING dualrl.backends.jax_pjit.sharding: row-major order",
    ]
    assert console.getvalue().splitlines() == ["WARNING dualrl.backends.jax_pjit.sharding: row-major order"]
