"""One line for a report about a failure that did not stop the run (its traceback goes to stderr)."""

from __future__ import annotations

import traceback


def error_text(err: BaseException) -> str:
    """``"Type: last line"`` of ``err``; call it in the ``except`` block, so the traceback is printed.

    The last non-empty line: a Ray worker's error carries the remote traceback in its text, and
    its last line is the error itself."""
    traceback.print_exc()
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"
