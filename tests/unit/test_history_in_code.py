"""tools/history_in_code.py: measurements live in docs/results.md, not in code or other pages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("history_in_code", REPO / "tools" / "history_in_code.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checkout_has_no_history_in_code_or_pages():
    assert _tool().hits() == []


def test_it_finds_dates_and_measurements_in_comments_and_docstrings_only(tmp_path):
    tool = _tool()
    tool.REPO = tmp_path
    source = tmp_path / "core" / "bad.py"
    source.parent.mkdir()
    source.write_text(
        '"""Module.\n\nMeasured on 2026-11-26."""\n'
        "X = 1  # measured: 0.41 s per pass\n"
        "Y = 2  # takes 3 s on a busier machine\n"
        'STAMP = "2026-11-26"  # a date the program prints is data\n'
        "TIMEOUT_S = 600  # seconds: a default, not a measurement\n"
        "Z = 3  # 6.5 / 33 ms against 26 / 48 ms\n"
        "W = 4  # the fused kernel: ~2.4x faster on CPU\n"
        "V = 5  # a stream of 128 MB per bucket, 2x the smallest\n"
    )
    config = tmp_path / "core" / "configs" / "run.yaml"
    config.parent.mkdir()
    config.write_text("lr: 2.0e-4  # measured at 64 x 8: +22.5 points\nsteps: 300  # 2026-11-27 recipe\n")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("Measured 2026-11-26.\n")
    (tmp_path / "docs" / "results.md").write_text("2026-11-26: allowed here\n")
    assert sorted(h.split(": ")[0] for h in tool.code_hits(source)) == [
        "core/bad.py:3",
        "core/bad.py:4",
        "core/bad.py:5",
        "core/bad.py:8",
        "core/bad.py:9",
    ]
    assert [h.split(": ")[0] for h in tool.code_hits(config)] == ["core/configs/run.yaml:1", "core/configs/run.yaml:2"]
    assert [h.split(": ")[0] for h in tool.page_hits(page)] == ["docs/page.md:1"]
    assert page in tool.pages() and tmp_path / "docs" / "results.md" not in tool.pages()
