"""``core.losses.metrics``: the one per-step metric collector of both engines' workers.

The same micro-batch metrics give the same table, totals and per-micro-batch lists on
torch and jax, and ``read_once`` brings every part of a step back in a single read.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.losses.metrics import MicroBatchMetrics, read_once
from tests.unit.engines import ENGINES, to_engine, to_numpy

# Three micro batches; the second did not report "kl" (e.g. a loss that skips it).
ROWS = [
    {"loss": 0.25, "kl": 0.5, "clip_frac": 0.125},
    {"loss": 0.5, "clip_frac": 0.0625},
    {"loss": 1.0, "kl": -0.25, "clip_frac": 0.375},
]


def _scalar(engine: str, value: float):
    if engine == "torch":
        import torch

        return torch.tensor(value, dtype=torch.float32)
    import jax.numpy as jnp

    return jnp.asarray(value, jnp.float32)


def _collect(engine: str) -> MicroBatchMetrics:
    collected = MicroBatchMetrics()
    for row in ROWS:
        collected.add({k: _scalar(engine, v) for k, v in row.items()})
    return collected


@pytest.mark.parametrize("engine", ENGINES)
def test_table_has_a_column_per_metric_and_zero_where_a_micro_batch_reported_none(engine):
    collected = _collect(engine)
    assert collected.keys == ["clip_frac", "kl", "loss"] and len(collected) == 3
    table = collected.table(to_engine(engine, np.zeros((), np.int64)))  # an integer like still gives float32
    assert str(table.dtype).endswith("float32")
    np.testing.assert_array_equal(to_numpy(table), [[0.125, 0.5, 0.25], [0.0625, 0.0, 0.5], [0.375, -0.25, 1.0]])


@pytest.mark.parametrize("engine", ENGINES)
def test_one_read_gives_totals_and_per_micro_batch_values(engine):
    collected = _collect(engine)
    table = collected.table(to_engine(engine, np.zeros((), np.float32)))
    norm = _scalar(engine, 2.5)
    totals, per_mb, (norm_value,) = read_once(table.sum(0), table, norm)
    assert dict(zip(collected.keys, totals, strict=True)) == {"clip_frac": 0.5625, "kl": 0.25, "loss": 1.75}
    assert norm_value == 2.5 and all(isinstance(v, float) for v in per_mb)
    # A micro batch that did not report a metric is left out of that metric's list.
    assert collected.per_micro_batch(per_mb) == {
        "clip_frac": [0.125, 0.0625, 0.375],
        "kl": [0.5, -0.25],
        "loss": [0.25, 0.5, 1.0],
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_a_metric_that_is_not_a_scalar_is_refused_by_name(engine):
    with pytest.raises(ValueError, match="metric 'kl': expected a 0-d array.*shape \\(2,\\)"):
        MicroBatchMetrics().add({"loss": _scalar(engine, 1.0), "kl": to_engine(engine, np.zeros(2, np.float32))})


@pytest.mark.parametrize("engine", ENGINES)
def test_no_metrics_gives_an_empty_table(engine):
    collected = MicroBatchMetrics()
    collected.add({})
    table = collected.table(to_engine(engine, np.zeros((), np.float32)))
    assert tuple(table.shape) == (1, 0) and collected.per_micro_batch(read_once(table)[0]) == {}


def test_read_once_is_one_host_copy_on_torch(monkeypatch):
    """Every ``.tolist``/``.item`` of a CUDA tensor waits for the device: the parts travel as
    one concatenated tensor, read by a single ``tolist``."""
    import torch

    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    parts = (torch.tensor([1.0, 2.0]), torch.ones(2, 3), torch.tensor(7.0))
    assert read_once(*parts) == [[1.0, 2.0], [1.0] * 6, [7.0]]
    assert reads == [torch.Size([9])]


def test_mixing_engines_is_refused():
    import jax.numpy as jnp
    import torch

    with pytest.raises(TypeError, match="different engines"):
        read_once(torch.zeros(1), jnp.zeros(1))
