"""A step's loss metrics over its micro batches, read on the host once per step.

Losses return detached 0-d arrays (torch or jax).  Reading one with ``float()`` waits for the
device to finish everything queued before it, so reading per micro batch would stall the
pipeline after every micro batch.  Both engines' workers therefore keep a step's metrics as
device arrays in a :class:`MicroBatchMetrics`, stack them into one [micro batches, metrics]
table on the device (summed there for the step's totals, all-reduced there on torch), and
read the table together with the step's other values (counts, gradient norm, skip flag) in
one :func:`read_once`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.kernels.ops import ops_for

#: Whole-batch metrics a loss reports as a summable offset-free part: ``name -> (part, offset)``.
#: The mean of ``exp(|lp_gen - lp_policy|)`` is 1 + the mean of ``expm1(...)``; summing
#: per-micro-batch shares of the mean itself would give 1.0000001 where every token agrees.
OFFSET_METRICS = {"token_mult_prob_error": ("token_mult_prob_excess", 1.0)}


def whole_batch_metrics(totals: Mapping[str, float]) -> dict[str, float]:
    """The summed loss metrics of a global batch, each ``OFFSET_METRICS`` entry set to its
    offset + its part's sum (so it is exact whenever the part is)."""
    out = dict(totals)
    for name, (part, offset) in OFFSET_METRICS.items():
        if part in out:
            out[name] = offset + out[part]
    return out


def read_once(*parts: Any) -> list[list[float]]:
    """Each array of ``parts`` (torch tensors or jax arrays, any shape) as a flat list of
    Python floats, through one device->host transfer for all of them."""
    if not parts:
        return []
    return ops_for(*parts).read_floats(parts)


class MicroBatchMetrics:
    """The loss metrics of one global batch's micro batches, kept on the device.

    Every metric is normalised by the global batch's counts, so summing it over the micro
    batches (and data-parallel ranks) gives its whole-batch value.
    """

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []

    def add(self, metrics: Mapping[str, Any]) -> None:
        """One micro batch's metrics: 0-d arrays (a loss's metrics are scalars)."""
        for key, value in metrics.items():
            if tuple(getattr(value, "shape", (None,))) != ():
                raise ValueError(
                    f"metric {key!r}: expected a 0-d array, got {type(value).__name__} "
                    f"of shape {tuple(getattr(value, 'shape', ()))}"
                )
        self._rows.append({k: ops_for(v).stop_gradient(v) for k, v in metrics.items()})

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def keys(self) -> list[str]:
        """Every metric name, sorted: the table's columns."""
        return sorted({k for row in self._rows for k in row})

    def table(self, like: Any) -> Any:
        """[micro batches, keys] float32 array on the engine and device of ``like`` (0 where a
        micro batch did not report a metric)."""
        ops = ops_for(like)
        keys = self.keys
        zero = ops.to_compute(ops.zeros((), like))  # float32 (float64 if like is), on like's device
        if not keys:
            return ops.zeros((len(self._rows), 0), zero)
        rows = [
            ops.concat([ops.expand_dims(ops.astype(row.get(k, zero), zero.dtype), 0) for k in keys], 0)
            for row in self._rows
        ]
        return ops.concat([ops.expand_dims(r, 0) for r in rows], 0)

    def per_micro_batch(self, values: Sequence[float]) -> dict[str, list[float]]:
        """``{metric: [micro batch 0, 1, ...]}`` from the row-major host values of
        :meth:`table` (a micro batch that did not report a metric is left out of its list)."""
        keys = self.keys
        out: dict[str, list[float]] = {}
        for r, row in enumerate(self._rows):
            for i, key in enumerate(keys):
                if key in row:
                    out.setdefault(key, []).append(values[r * len(keys) + i])
        return out
