"""Batch checks shared by the Policy facade (driver side) and every backend's workers.

They run before any collective starts, so bad input fails in milliseconds with a message
naming the key, the shape and the config field, instead of hanging a process group.
"""

from __future__ import annotations

from typing import Any, Mapping


class BatchError(ValueError):
    """A batch the policy cannot process; the message names the culprit."""


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
            f"a sequence has {longest} tokens but policy.max_total_sequence_length is "
            f"{max_total_sequence_length}"
        )
    if longest > ids.shape[1] or int(lengths.min()) < 1:
        raise BatchError(
            f"data['input_lengths'] must lie in [1, {ids.shape[1]}] (the width of input_ids), got "
            f"[{int(lengths.min())}, {longest}]"
        )


def check_train_batch(
    data: Mapping[str, Any], gbs: int, mbs: int, dp: int, max_total_sequence_length: int, local: bool = True
) -> int:
    """Validate a training batch; returns the rows per rank and global batch (gbs / dp).

    ``local``: ``data`` is one data-parallel rank's shard (workers) rather than the whole
    batch (the driver).
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
    rows = gbs // dp if local else gbs
    size = data["input_ids"].shape[0]
    if size == 0 or size % rows:
        where = "this rank's shard" if local else "the batch"
        raise BatchError(f"{where} has {size} rows, not a positive multiple of the global batch size {rows}"
                         + (f" / dp {dp}" if local else ""))
    return rows


def check_loss_inputs(loss_fn: Any, data: Mapping[str, Any], vocab_size: int | None) -> None:
    """Run a loss's own input checks (keys, shapes, finite values, ids in the vocabulary) on
    the host batch, if the loss has them (``core.losses`` objects do)."""
    check = getattr(loss_fn, "check", None)
    if check is not None:
        check.check_shapes(None, data)
        check.check_values(data, vocab_size)
