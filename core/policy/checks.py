"""Batch checks shared by the Policy facade (driver side) and every backend's workers.

They run before any collective starts, so bad input fails in milliseconds with a message
naming the key, the shape and the config field, instead of hanging a process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from core.interfaces import LossFunction, LossType
from core.losses.contract import LossContract


class BatchError(ValueError):
    """A batch the policy cannot process; the message names the culprit."""


#: Masks the losses and the packing read; each must hold finite weights in [0, 1].
MASK_KEYS = ("token_mask", "sample_mask")


def check_model_inputs(data: Mapping[str, Any], vocab_size: int | None, what: str = "data") -> None:
    """What every backend's forward needs of a batch, checked on the driver so that bad input
    never reaches a worker: at least one row; integer ``input_ids`` with every id (padding
    included: the embedding reads it too) in [0, vocab_size); integer ``input_lengths``;
    masks finite and in [0, 1].  Torch tensors or numpy arrays."""
    ids = _as_tensor(data["input_ids"])
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise BatchError(
            f"{what}['input_ids'] must be a non-empty [B, S] batch, got shape {tuple(ids.shape)}"
            + (" (an empty batch)" if ids.ndim == 2 else "")
        )
    for key in ("input_ids", "input_lengths"):
        dtype = _as_tensor(data[key]).dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise BatchError(f"{what}[{key!r}] must hold integers, got dtype {dtype}")
    if vocab_size is not None:
        _check_id_range(ids, vocab_size, what)
    for key in MASK_KEYS:
        if key in data and data[key] is not None:
            _check_mask(_as_tensor(data[key]), f"{what}[{key!r}]")


def check_prompt_room(data: Mapping[str, Any], limit: int, field: str = "policy.max_total_sequence_length") -> None:
    """Prompts as wide as the sequence limit leave no room for a single new token."""
    width = int(data["input_ids"].shape[1])
    if width >= limit:
        raise BatchError(
            f"prompts are {width} tokens wide but {field}={limit}: no room to generate a token "
            f"(generate needs prompt width < {limit})"
        )


def check_loss_fn(loss_fn: Any) -> LossContract:
    """A loss the training loop can drive (a ``core.interfaces.LossFunction``); returns what it
    declares of the loss contract (``core.losses.contract.LossContract``)."""
    if not isinstance(loss_fn, LossFunction) or not isinstance(getattr(loss_fn, "loss_type", None), LossType):
        raise TypeError(
            f"loss_fn must be a core.interfaces.LossFunction (callable(next_token_logits, data, "
            f"global_valid_seqs, global_valid_toks) with a LossType `loss_type`), e.g. "
            f"core.losses.ClippedPGLossFn; got {type(loss_fn).__name__}: {loss_fn!r:.80}"
        )
    return LossContract.of(loss_fn)


def check_one_step_for_fused_old_logprobs(contract: LossContract, rows: int, gbs: int, eval_mode: bool) -> None:
    """A loss that takes the old policy's logprobs from its own training forward
    (``old_logprobs="forward"``) is exact for one optimizer step only: after the first step the
    weights being trained are no longer the ones that scored the batch."""
    if eval_mode or contract.old_logprobs != "forward" or rows <= gbs:
        return
    raise ValueError(
        f"loss_fn takes the old logprobs from the training forward (old_logprobs='forward'), which is exact "
        f"for one optimizer step, but this batch of {rows} rows is {rows // gbs} optimizer steps of "
        f"train_global_batch_size={gbs}: pass prev_logprobs from a get_logprobs pass and "
        f"ClippedPGLossFn(cfg, old_logprobs='batch') (GRPO does when grpo.num_prompts_per_step x "
        f"num_generations_per_prompt != policy.train_global_batch_size)"
    )


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        # Ray hands numpy arrays out of its object store read-only (the vLLM engine actors get
        # their prompts that way), and a tensor sharing a read-only buffer is undefined behaviour
        # in torch (it warns).  The checks only read a batch of ids or masks: copy it.
        x = x.copy()
    return torch.as_tensor(x)


def _check_id_range(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise BatchError(
            f"{what}['input_ids'][{row}, {col}] = {int(ids[row, col])} is outside the vocabulary "
            f"[0, {vocab_size}) ({int(bad.sum())} such ids; padding must be a valid id too)"
        )


def _check_mask(mask: torch.Tensor, where: str) -> None:
    if mask.dtype == torch.bool:
        return
    if not mask.dtype.is_floating_point:
        mask = mask.float()
    bad = ~torch.isfinite(mask) | (mask < 0) | (mask > 1)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise BatchError(
            f"{where}{list(index)} = {float(mask[index])}: masks must be finite and in [0, 1] "
            f"({int(bad.sum())} bad entries)"
        )


def check_sequence_lengths(data: Mapping[str, Any], max_total_sequence_length: int) -> None:
    """``input_ids`` [B, S] and ``input_lengths`` [B] present, consistent, and within the limit."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise BatchError(f"data is missing {key!r}; it has {sorted(data.keys())}")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if len(ids.shape) != 2:
        raise BatchError(f"data['input_ids'] must be [B, S], got shape {tuple(ids.shape)}")
    if tuple(lengths.shape) != (ids.shape[0],):
        raise BatchError(
            f"data['input_lengths'] must have shape ({ids.shape[0]},) to match input_ids {tuple(ids.shape)}, "
            f"got {tuple(lengths.shape)}"
        )
    if ids.shape[0] == 0:
        return
    longest = int(lengths.max())
    if longest > max_total_sequence_length:
        raise BatchError(
            f"a sequence has {longest} tokens but policy.max_total_sequence_length is {max_total_sequence_length}"
        )
    if longest > ids.shape[1] or int(lengths.min()) < 1:
        raise BatchError(
            f"data['input_lengths'] must lie in [1, {ids.shape[1]}] (the width of input_ids), got "
            f"[{int(lengths.min())}, {longest}]"
        )


def check_train_batch(
    data: Mapping[str, Any],
    gbs: int,
    mbs: int,
    dp: int,
    max_total_sequence_length: int,
    local: bool = True,
    shards: int | None = None,
) -> int:
    """Validate a training batch of ``mbs`` rows per micro batch on each of ``dp``
    data-parallel devices; returns the rows per shard and global batch (gbs / shards).

    ``local``: ``data`` is one shard (a worker's) rather than the whole batch (the driver).
    ``shards``: the workers the rows are sharded over (default ``dp``: a worker per device).
    """
    check_sequence_lengths(data, max_total_sequence_length)
    if gbs <= 0 or mbs <= 0:
        raise BatchError(f"global batch size ({gbs}) and micro batch size ({mbs}) must be positive")
    if gbs % (dp * mbs):
        raise BatchError(
            f"global batch size {gbs} (policy.train_global_batch_size or gbs=) is not divisible by "
            f"data-parallel size {dp} x micro batch size {mbs} = {dp * mbs}"
        )
    if "sample_mask" not in data:
        raise BatchError(f"training data is missing 'sample_mask'; it has {sorted(data.keys())}")
    shards = shards or dp
    rows = gbs // shards if local else gbs
    size = data["input_ids"].shape[0]
    if size == 0 or size % rows:
        where = "this rank's shard" if local else "the batch"
        raise BatchError(
            f"{where} has {size} rows, not a positive multiple of the global batch size {rows}"
            + (f" / {shards} shards" if local else "")
        )
    return rows
