"""Masked reductions with an optional global normaliser.

Why a *global* normaliser: a micro batch only sees part of the batch.  Dividing each
micro batch's masked sum by the count of valid tokens (or sequences) in the whole global
batch, all-reduced over data-parallel ranks, makes the sum over micro batches and ranks
equal the full-batch mean, so loss and gradients do not depend on micro-batch size or on
the number of ranks.
"""

from __future__ import annotations

from core.kernels.ops import EPS, ops_for


def _mask_like(ops, mask, values):
    return ops.astype(mask, values.dtype)


def masked_sum(values, mask, axis=None):
    """sum(values * mask) over ``axis`` (all axes when None)."""
    ops = ops_for(values)
    return ops.sum(values * _mask_like(ops, mask, values), axis=axis)


def masked_mean(values, mask, axis=None, global_normalization_factor=None):
    """sum(values * mask, axis) / (normaliser + 1e-8).

    The normaliser is ``mask.sum(axis)`` unless ``global_normalization_factor`` is given
    (a number or 0-d array: the valid count of the whole global batch).  The ``1e-8``
    keeps NeMo RL's semantics: an all-masked input gives exactly 0, not NaN.
    """
    ops = ops_for(values)
    m = _mask_like(ops, mask, values)
    total = ops.sum(values * m, axis=axis)
    norm = ops.sum(m, axis=axis) if global_normalization_factor is None else global_normalization_factor
    return total / (norm + EPS)
