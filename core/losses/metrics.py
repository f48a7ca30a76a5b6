"""Collecting a step's loss metrics over micro batches without a host sync per micro batch.

Losses return detached 0-d arrays (torch or jax).  Reading one with ``float()`` waits for the
device, so doing it inside the micro-batch loop would stall the pipeline after every micro
batch; ``MicroBatchMetrics`` keeps the arrays and reads them once, after the step.
"""

from __future__ import annotations

from typing import Any, Mapping


class MicroBatchMetrics:
    """The metrics of one step's micro batches, in order."""

    def __init__(self) -> None:
        self._micro_batches: list[dict[str, Any]] = []

    def add(self, metrics: Mapping[str, Any]) -> None:
        self._micro_batches.append(dict(metrics))

    def totals(self) -> dict[str, Any]:
        """Each metric summed over the micro batches (arrays of the metrics' engine): the
        step's value, since every metric is normalised by global counts."""
        totals: dict[str, Any] = {}
        for metrics in self._micro_batches:
            for key, value in metrics.items():
                totals[key] = value if key not in totals else totals[key] + value
        return totals

    def per_micro_batch(self) -> dict[str, list[float]]:
        """``{metric: [value of micro batch 0, 1, ...]}`` as Python floats (reads the device)."""
        out: dict[str, list[float]] = {}
        for metrics in self._micro_batches:
            for key, value in metrics.items():
                out.setdefault(key, []).append(float(value))
        return out
