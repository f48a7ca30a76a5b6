"""The few formatting helpers the benchmark reports share: a number cell, a markdown table, a
spread of timings, a threads cell."""

from __future__ import annotations

import math
import statistics


def cell(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec``; ``-`` for a value not measured (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def pct(x: float | None) -> float | None:
    """A fraction as a percentage (None stays None)."""
    return None if x is None else 100 * x


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def spread(times: list[float] | None) -> str:
    """``median [min, max]`` of timings."""
    if not times:
        return "-"
    return f"{statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}]"


def threads_cell(result: dict) -> str:
    """The threads of a case's processes: one number when all have the same."""
    threads = result.get("threads")
    if not threads:
        return "?"
    return str(threads[0]) if len(set(threads)) == 1 else "/".join(map(str, threads))
