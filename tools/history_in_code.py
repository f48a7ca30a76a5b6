"""Measurements live in docs/results.md: no dates, timings or history in code or other pages.

    python tools/history_in_code.py --check   # exit 1, one line per hit (make lint runs it)

A number measured on some machine on some day goes stale in a comment, where nobody re-measures
it; docs/results.md holds every measured table with its date, machine and command, and the code
says *why* ("faster on CPU: docs/results.md#...").  Flagged:

* in the comments and docstrings of the code (``core/``, ``backends/``, ``benchmarks/``,
  ``dualrl/``, ``tools/``), the YAML configs' comments and the Makefile's comments: an ISO date;
  a "measured"/"on a busier machine"-style phrase next to a time, a ratio or a rate; a time or
  rate that only a measurement gives (milliseconds, seconds per step, FLOP/s, GB/s, tokens/s) or
  an "N x faster" speed-up, on its own;
* in the documentation (README.md and docs/*.md except docs/results.md): an ISO date.

String literals that are not docstrings (messages, data) are not read: a date a program
prints or parses is data, not history.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("core", "backends", "benchmarks", "dualrl", "tools")
#: The one page that carries dates (and the pages that may not).
RESULTS_PAGE = "docs/results.md"
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
#: A measurement phrase with a number and a unit of time, speed or ratio on the same line.
MEASURED = re.compile(r"(?i)\b(measured|busier machine|loaded machine|quiet machine|on this machine)\b")
QUANTITY = re.compile(r"\d(?:\.\d+)?\s*(?:s|ms|min|seconds|x|%|GFLOP/s|tok/s|points?)(?![\w/])")
#: A time or rate no default or limit is written in, and a speed-up: measurements on their own.
TIMING = re.compile(r"\d(?:\.\d+)?\s*(?:ms|s/step|[GT]FLOP/s|[GM]B/s|tok(?:ens)?/s)(?![\w/])")
SPEEDUP = re.compile(r"(?i)\d(?:\.\d+)?x (?:faster|slower)\b")
_DOCSTRING_BEFORE = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def _python_texts(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring-like string of a Python source."""
    previous = tokenize.ENCODING
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and previous in _DOCSTRING_BEFORE:
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def _hash_comments(text: str) -> Iterator[tuple[int, str]]:
    """(line, comment) of a YAML file or Makefile: what follows a ``#``."""
    for number, line in enumerate(text.splitlines(), 1):
        if "#" in line:
            yield number, line[line.index("#") :]


def code_hits(path: Path) -> Iterator[str]:
    text = path.read_text()
    texts = _python_texts(text) if path.suffix == ".py" else _hash_comments(text)
    rel = path.relative_to(REPO)
    for number, line in texts:
        if DATE.search(line):
            yield f"{rel}:{number}: a date in a comment or docstring (move the measurement to {RESULTS_PAGE})"
        elif (MEASURED.search(line) and QUANTITY.search(line)) or TIMING.search(line) or SPEEDUP.search(line):
            yield f"{rel}:{number}: a measurement in a comment or docstring (move it to {RESULTS_PAGE})"


def page_hits(path: Path) -> Iterator[str]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if DATE.search(line):
            yield f"{path.relative_to(REPO)}:{number}: a date outside {RESULTS_PAGE} (link its section there instead)"


def code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py")) if "__pycache__" not in p.parts]
    return files + sorted((REPO / "core" / "configs").glob("*.yaml")) + [REPO / "Makefile"]


def pages() -> list[Path]:
    pages = [REPO / "README.md"] if (REPO / "README.md").exists() else []
    return pages + [p for p in sorted((REPO / "docs").glob("*.md")) if p != REPO / RESULTS_PAGE]


def hits() -> list[str]:
    return [hit for p in code_files() for hit in code_hits(p)] + [hit for p in pages() for hit in page_hits(p)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is flagged")
    args = parser.parse_args(argv)
    found = hits()
    for line in found:
        print(line)
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main())
