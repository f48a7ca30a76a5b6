"""Negative log-likelihood (SFT) loss, torch or jax."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.interfaces import LossType
from core.kernels import masked_mean, masked_sum, next_token_logprobs, ops_for
from core.losses.checks import LossInputChecker
from core.losses.contract import DeclaredLoss


def sequence_masks(ops, data: Mapping[str, Any], dtype):
    """(token_mask [B, S-1], sample_mask [B], mask = token_mask * sample_mask) in ``dtype``."""
    token_mask = ops.astype(data["token_mask"][:, 1:], dtype)
    sample_mask = ops.astype(data["sample_mask"], dtype)
    return token_mask, sample_mask, token_mask * ops.expand_dims(sample_mask, -1)


def per_sequence_logprob(curr_logprobs, mask, average: bool):
    """Sum (or mean, with ``average``) of each sequence's valid next-token logprobs: [B]."""
    ops = ops_for(curr_logprobs)
    total = masked_sum(curr_logprobs, mask, axis=-1)
    if not average:
        return total
    return total / ops.clip(ops.sum(ops.astype(mask, total.dtype), axis=-1), 1.0, None)


class NLLLoss(DeclaredLoss):
    """Token-level NLL: -sum(log p(x_t) * mask) / global_valid_toks.

    Data keys: ``input_ids``, ``token_mask``, ``sample_mask`` ([B, S], [B, S], [B]); no old
    logprobs, no reference (the loss contract's defaults, ``core.losses.contract.DeclaredLoss``).
    Returns ``(loss, metrics)`` with detached 0-d array metrics (see ``ClippedPGLossFn``).
    """

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self) -> None:
        self.check = LossInputChecker("NLLLoss", ("token_mask",), finite_keys=())

    def __call__(self, next_token_logits, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        self.check(next_token_logits, data)
        curr_logprobs = next_token_logprobs(next_token_logits, data["input_ids"])
        return self.loss_from_logprobs(curr_logprobs, data, global_valid_seqs, global_valid_toks)

    def loss_from_logprobs(self, curr_logprobs, data, global_valid_seqs, global_valid_toks):
        ops = ops_for(curr_logprobs)
        _, sample_mask, mask = sequence_masks(ops, data, curr_logprobs.dtype)
        if global_valid_toks is None:
            global_valid_toks = ops.sum(mask)
        loss = -masked_mean(curr_logprobs, mask, global_normalization_factor=global_valid_toks)
        sg = ops.stop_gradient
        return loss, {
            "loss": sg(loss),
            "num_unmasked_tokens": sg(ops.sum(mask)),
            "num_valid_samples": sg(ops.sum(sample_mask)),
        }
