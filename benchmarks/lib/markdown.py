"""The few formatting helpers the benchmark reports share: a number cell and a markdown table."""

from __future__ import annotations

import math


def cell(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec``; ``-`` for a value not measured (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def pct(x: float | None) -> float | None:
    """A fraction as a percentage (None stays None)."""
    return None if x is None else 100 * x


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
