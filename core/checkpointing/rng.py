"""The driver's random-number state: capture, restore, and its file in a checkpoint.

Three generators drive a run's randomness on the driver: Python's ``random`` (e.g. data
shuffling helpers), numpy's global RNG and torch's CPU generator.  A resumed run restores
all three so that the draws after step N are the ones the uninterrupted run would have
made.  (Sampling randomness inside vLLM / the policy workers is seeded per step by the
loop, not captured here.)

numpy and torch are imported inside the functions so that ``import core.checkpointing``
stays light; they are already imported by every process that trains.

The state is stored with :mod:`pickle` (``rng_state.pkl``), not ``torch.save``: it holds
numpy's state tuple (an ndarray inside), which ``torch.load``'s default ``weights_only``
mode refuses, and pickle needs no torch to read it back.  Like any pickle it must only be
loaded from a checkpoint directory one trusts (one's own run directory).
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.checkpointing.manifest import CheckpointError

__all__ = ["RNG_KEYS", "capture_rng_state", "restore_rng_state", "save_rng_state", "load_rng_state"]

RNG_KEYS = ("python", "numpy", "torch")


def capture_rng_state() -> dict[str, Any]:
    """Snapshot of the driver's generators: ``{"python", "numpy", "torch"}``; picklable.

    The torch CPU state is kept as ``bytes`` (not a tensor) so that reading it back needs
    no torch and compares with ``==``.
    """
    import numpy as np
    import torch

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put the generators back in the state :func:`capture_rng_state` returned.

    Raises :class:`CheckpointError` naming the key when one is missing or unknown: a
    silently half-restored RNG would make a resumed run diverge without a trace.
    """
    missing = [k for k in RNG_KEYS if k not in state]
    unknown = sorted(set(state) - set(RNG_KEYS))
    if missing or unknown:
        raise CheckpointError(
            f"rng state has keys {sorted(state)}; expected {list(RNG_KEYS)} (missing {missing}, unknown {unknown})"
        )
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch_state = state["torch"]
    if isinstance(torch_state, (bytes, bytearray)):
        torch_state = torch.frombuffer(bytearray(torch_state), dtype=torch.uint8).clone()
    torch.set_rng_state(torch_state)


def save_rng_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` (any picklable mapping) to ``path`` with pickle."""
    with open(path, "wb") as f:
        pickle.dump(dict(state), f, protocol=pickle.HIGHEST_PROTOCOL)


def load_rng_state(path: Path) -> dict[str, Any]:
    """Read a state written by :func:`save_rng_state`; a clear error naming the file."""
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointError(f"cannot read rng state {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"rng state {path} holds a {type(state).__name__}, expected a dict")
    return state
