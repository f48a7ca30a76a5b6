"""pytest silences no DeprecationWarning wholesale: one that torch raises about the private APIs
the backends use (backends/torch_common/torch_private.py) reaches the summary, and any filter
that ignores one names its message or module (pyproject.toml ``filterwarnings``)."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILTERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning, PendingDeprecationWarning])
def test_a_deprecation_raised_from_torch_reaches_the_test(category):
    """Under this session's filters (pytest applies the ini ones around every test)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(
            "torch.distributed.fsdp._runtime_utils._reshard is deprecated and will be removed",
            category,
            filename="torch/distributed/fsdp/_runtime_utils.py",
            lineno=1,
            module="torch.distributed.fsdp._runtime_utils",
        )
    assert [w.category for w in seen] == [category]


def test_every_ignored_deprecation_is_named():
    for line in FILTERS:
        action, message, category, module = (line.split(":") + ["", "", ""])[:4]
        if action == "ignore" and "Deprecation" in category:
            assert message or module, f"filterwarnings {line!r} ignores a whole category; name the message or module"
