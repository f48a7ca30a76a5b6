"""What the project logged (:mod:`core.reporting`'s ``dualrl`` loggers), for tests that used to
catch a ``warnings.warn``: the same assertion, through pytest's ``caplog``."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import pytest

from core import reporting


@contextlib.contextmanager
def warns(
    caplog: pytest.LogCaptureFixture, pattern: str = "", monkeypatch: pytest.MonkeyPatch | None = None
) -> Iterator[None]:
    """Inside: a ``dualrl`` logger must log a warning matching ``pattern`` (``re.search``).
    ``monkeypatch``: forget the notes said once (``reporting.warn_once``) for the block."""
    if monkeypatch is not None:
        monkeypatch.setattr(reporting, "_warned", set())
    start = len(caplog.records)
    with caplog.at_level(logging.WARNING, logger=reporting.ROOT_LOGGER):
        yield
    found = [r.getMessage() for r in caplog.records[start:] if r.levelno >= logging.WARNING]
    assert any(re.search(pattern, m) for m in found), f"no warning matching {pattern!r}; logged: {found}"


@contextlib.contextmanager
def no_warning(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Inside: no ``dualrl`` logger logs a warning."""
    start = len(caplog.records)
    with caplog.at_level(logging.WARNING, logger=reporting.ROOT_LOGGER):
        yield
    found = [r.getMessage() for r in caplog.records[start:] if r.levelno >= logging.WARNING]
    assert found == []
