"""Reading device values on the host once per step instead of once per value.

Every ``float(tensor)`` / ``.item()`` / ``.cpu()`` of a CUDA tensor waits for the device to
finish all queued work; inside a micro-batch loop that stalls the pipeline after each micro
batch.  The torch workers therefore keep a step's values (loss metrics per micro batch,
global counts, the gradient norm) as device tensors and read them with :func:`read_once`:
one device->host copy for all of them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def read_once(*parts: torch.Tensor) -> list[list[float]]:
    """Each tensor of ``parts`` as a flat list of Python floats, through one host copy."""
    if not parts:
        return []
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in parts])
    values = flat.tolist()  # the one synchronisation
    out, start = [], 0
    for p in parts:
        out.append(values[start:start + p.numel()])
        start += p.numel()
    return out


class DeviceMetrics:
    """The loss metrics of one global batch's micro batches, kept on the device.

    Losses return detached 0-d tensors; summing a metric over the micro batches (and dp
    ranks) gives its whole-batch value, since each is normalised by the global counts.
    """

    def __init__(self) -> None:
        self._rows: list[dict[str, torch.Tensor]] = []

    def add(self, metrics: Mapping[str, torch.Tensor]) -> None:
        self._rows.append({k: v.detach().float() for k, v in metrics.items()})

    @property
    def keys(self) -> list[str]:
        """Every metric name, sorted (micro batches of one loss report the same names)."""
        return sorted({k for row in self._rows for k in row})

    def table(self, device: torch.device) -> torch.Tensor:
        """[micro batches, keys] float32 (0 where a micro batch did not report a metric)."""
        keys = self.keys
        if not self._rows or not keys:
            return torch.zeros(len(self._rows), len(keys), device=device)
        zero = torch.zeros((), device=device)
        return torch.stack([torch.stack([row.get(k, zero).to(device) for k in keys]) for row in self._rows])

    def per_micro_batch(self, values: Sequence[float]) -> dict[str, list[float]]:
        """``{metric: [micro batch 0, 1, ...]}`` from the row-major values of :meth:`table`
        (a micro batch that did not report a metric is left out of its list)."""
        keys = self.keys
        out: dict[str, list[float]] = {}
        for r, row in enumerate(self._rows):
            for i, key in enumerate(keys):
                if key in row:
                    out.setdefault(key, []).append(values[r * len(keys) + i])
        return out
