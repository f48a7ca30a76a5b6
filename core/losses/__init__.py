"""Losses shared by every backend: the same object runs on torch tensors and jax arrays.

Call convention: ``loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks)
-> (loss, metrics)``.  ``metrics`` values are detached 0-d arrays of the input's engine
(so the call also works inside ``jax.jit``); ``metrics_to_floats`` turns them into
Python numbers once the step is done.
"""

from core.losses.checks import LossInputChecker, LossInputError
from core.losses.clipped_pg import ClippedPGLossFn
from core.losses.dpo import DPOLossFn
from core.losses.nll import NLLLoss


def metrics_to_floats(metrics: dict) -> dict[str, float]:
    """Detached 0-d arrays (torch or jax) -> Python floats."""
    return {k: float(v) for k, v in metrics.items()}


__all__ = ["ClippedPGLossFn", "DPOLossFn", "LossInputChecker", "LossInputError", "NLLLoss", "metrics_to_floats"]
