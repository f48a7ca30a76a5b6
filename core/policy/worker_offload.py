"""Where a worker's weights and optimizer state live, in the four states the driver moves it
through -- written once, the engine supplying only the moves.

=====================  ==================  ======================  ==========
state (driver call)    weights             optimizer state         model mode
=====================  ==================  ======================  ==========
prepare_for_training   device              device                  train
prepare_for_lp_...     device              host                    eval
offload_before_refit   (where they are)    host                    --
offload_after_refit    host                host                    --
=====================  ==================  ======================  ==========

Host memory is what a colocated generation engine needs freed: before a refit the optimizer
state leaves the device (the weights are streamed from it), after the refit the weights too.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple


class Residency(NamedTuple):
    """Where a state keeps its parts: True the device, False host memory, None unchanged."""

    weights: bool | None
    optimizer: bool
    training_mode: bool | None  # the model's train / eval switch; None unchanged


#: The four states, by the driver call that enters each.
STATES = {
    "prepare_for_training": Residency(weights=True, optimizer=True, training_mode=True),
    "prepare_for_lp_inference": Residency(weights=True, optimizer=False, training_mode=False),
    "offload_before_refit": Residency(weights=None, optimizer=False, training_mode=None),
    "offload_after_refit": Residency(weights=False, optimizer=False, training_mode=None),
}


class WorkerOffload(abc.ABC):
    """The driver's four placement calls (mixed into ``PolicyWorkerBase``)."""

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Weights and optimizer state on the device, the model in training mode."""
        self._enter(STATES["prepare_for_training"])

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        """Weights on the device, optimizer state in host memory, the model in eval mode."""
        self._enter(STATES["prepare_for_lp_inference"])

    def offload_before_refit(self) -> None:
        """Free device memory for the refit: optimizer state to host memory."""
        self._enter(STATES["offload_before_refit"])

    def offload_after_refit(self) -> None:
        """The generation engine owns the device now: weights to host memory too."""
        self._enter(STATES["offload_after_refit"])

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        return None  # nothing to release: training state stays resident until offloaded

    def _enter(self, state: Residency) -> None:
        if state.weights is not None:
            self._move_weights(on_device=state.weights)
        if state.training_mode is not None:
            self._set_training_mode(state.training_mode)
        self._move_optimizer_state(on_device=state.optimizer)
        self._release_device_memory()

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _move_weights(self, on_device: bool) -> None:
        """The trainable weights to the device or to host memory (no-op where already there)."""

    @abc.abstractmethod
    def _move_optimizer_state(self, on_device: bool) -> None:
        """The optimizer state likewise (no-op without an optimizer)."""

    def _set_training_mode(self, training: bool) -> None:
        """The model's train / eval switch, for engines whose modules have one."""
        return None  # stateless apply functions have no mode

    def _release_device_memory(self) -> None:
        """Return freed device memory to the device (caching allocators)."""
        return None  # buffers freed with their last reference
