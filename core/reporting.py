"""One way to report a problem: the ``dualrl`` logger hierarchy.

Every module of the project logs through ``get_logger(__name__)`` -- ``dualrl.core.policy.policy``,
``dualrl.backends.<backend>.<module>``, ... -- so one handler on the ``dualrl`` logger decides where
the project's messages go, and a user silences or raises a part of it by name
(``logging.getLogger("dualrl.backends").setLevel(...)``).  ``warnings.warn`` is kept only where
Python's convention wants a warning: ``DeprecationWarning`` for a renamed API.

Where they go:

* the commands (``dualrl grpo``, ``dualrl bench``, ...) call :func:`show_logs_above_progress`:
  each record is written through ``tqdm.write``, above the run's progress bar (a plain print
  would continue the bar's line);
* as a library (tests, a notebook) nothing is installed: Python's last-resort handler prints
  warnings and errors to stderr, and ``INFO`` stays quiet unless the caller configures logging;
* a Ray worker whose output goes to the run's worker log
  (:func:`core.distributed.worker_output.redirect_worker_output`) still shows its warnings on
  the driver's console.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["ROOT_LOGGER", "ProgressBarHandler", "get_logger", "show_logs_above_progress", "warn_once"]

#: The name every project logger lives under.
ROOT_LOGGER = "dualrl"


def get_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``) in the ``dualrl`` hierarchy."""
    return logging.getLogger(module if module.split(".")[0] == ROOT_LOGGER else f"{ROOT_LOGGER}.{module}")


_warned: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time this process sees it (a note about a setting
    that holds for every call, e.g. each generate call's, said once rather than each time)."""
    if (logger.name, message) not in _warned:
        _warned.add((logger.name, message))
        logger.warning("%s", message)


class _LevelPrefix(logging.Formatter):
    """``message`` for INFO and below; ``WARNING message`` / ``ERROR message`` above."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname} {text}"


class ProgressBarHandler(logging.Handler):
    """Writes each record through ``tqdm.write``: tqdm clears the open progress bars, prints
    the line and redraws them, so a message never lands in the middle of a bar's line."""

    def __init__(self, level: int = logging.INFO, stream=None) -> None:
        super().__init__(level)
        self.stream = stream
        self.setFormatter(_LevelPrefix("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream or sys.stdout)
        except Exception:  # logging's contract: a failing handler reports through handleError, never raises
            self.handleError(record)


def show_logs_above_progress(level: int = logging.INFO) -> ProgressBarHandler:
    """Show the ``dualrl`` loggers' records of ``level`` and above through a
    :class:`ProgressBarHandler` (installed once; a second call sets the level).  What a command
    calls before it starts working."""
    root = logging.getLogger(ROOT_LOGGER)
    root.setLevel(level)
    for handler in root.handlers:
        if isinstance(handler, ProgressBarHandler):
            handler.setLevel(level)
            return handler
    handler = ProgressBarHandler(level)
    root.addHandler(handler)
    return handler
