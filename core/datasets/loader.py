"""Batches of examples (prompts, SFT sequences, DPO pairs) with a deterministic, checkpointable position.

The loader's whole state is ``(epoch, position)`` plus the numbers that define the order
(seed, dataset size, batch size), so a resumed run draws exactly the batches the
uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from core.datasets.base import EncodedDataset

# The loader properties a saved state must agree on: they decide which examples come next.
_IDENTITY_KEYS = ("dataset_size", "batch_size", "seed")


class BatchLoader:
    """Draws ``batch_size`` examples per call.

    Finite dataset: walks one permutation per epoch (``numpy.random.default_rng(seed +
    epoch)`` when ``shuffle``, else source order), drops the incomplete tail batch and
    moves on to the next epoch.  Infinite dataset: batch k is items ``k*batch_size ..``.
    """

    def __init__(self, dataset: EncodedDataset, batch_size: int, *, shuffle: bool, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if dataset.size is not None and batch_size > dataset.size:
            raise ValueError(
                f"batch_size {batch_size} is larger than the dataset "
                f"({dataset.size} examples): no full batch can be drawn"
            )
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.position = 0  # items of the current epoch (or of the stream) already drawn
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def next_batch(self) -> list[Any]:
        """The next ``batch_size`` examples; advances the position (and maybe the epoch)."""
        start = self.position
        if self.dataset.size is None:
            indices = range(start, start + self.batch_size)
        else:
            if start + self.batch_size > self.dataset.size:  # incomplete tail: next epoch
                self.epoch, start = self.epoch + 1, 0
            indices = self._epoch_order()[start : start + self.batch_size].tolist()
        self.position = start + self.batch_size
        return [self.dataset[i] for i in indices]

    def _epoch_order(self) -> np.ndarray:
        """The permutation of the current epoch (cached: computed once per epoch)."""
        if self._order is None or self._order_epoch != self.epoch:
            n = self.dataset.size
            if n is None:
                raise TypeError("an infinite dataset has no epoch order")
            self._order = np.random.default_rng(self.seed + self.epoch).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue from here (goes into a checkpoint)."""
        size = self.dataset.size
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_size": -1 if size is None else size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a saved state; refuse one taken on a different loader setup.

        Resuming with another dataset size, batch size or seed would silently draw other
        examples than the interrupted run, so the mismatch is an error naming the key.
        """
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise ValueError(f"loader state is missing keys {missing}; got {sorted(state)}")
        for key in _IDENTITY_KEYS:
            if int(state[key]) != own[key]:
                raise ValueError(
                    f"loader state {key}={state[key]} does not match this "
                    f"loader's {key}={own[key]}: resuming would draw other examples"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        limit = self.dataset.size
        if epoch < 0 or position < 0 or (limit is not None and position > limit):
            raise ValueError(
                f"loader state epoch={epoch} position={position} is out of range for a dataset of {limit} examples"
            )
        self.epoch, self.position = epoch, position
