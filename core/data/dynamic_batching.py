"""Token-budget ("dynamic") micro batching for :class:`~core.data.BatchedDataDict`.

Dynamic batching replaces fixed-size micro batches with micro batches whose
``rows * padded_length`` stays under a token budget, so short sequences are processed
many at a time and long ones a few at a time.  The steps, all applied per chunk of
``batch_size`` rows by ``BatchedDataDict.shard_by_batch_size``:

1. :func:`sort_and_deal` sorts the chunk by sequence length (longest first) and deals
   the rows round-robin over the data-parallel shards, so every shard sees a similar
   length distribution.
2. :func:`plan_lockstep_micro_batches` cuts the shards' rows into micro batches.  The
   plan is computed once for all shards so that every rank runs the same number of
   forward/backward passes; FSDP ranks that disagree on that number hang in a
   collective.

The planner is deliberately a standalone function returning a :class:`MicroBatchPlan`:
other strategies (e.g. sequence packing) can be added as further planners without
touching the sharding code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypedDict

import torch

__all__ = [
    "DynamicBatchingArgs",
    "MicroBatchPlan",
    "MissingKeyError",
    "plan_lockstep_micro_batches",
    "read_sequence_lengths",
    "round_up",
    "sort_and_deal",
    "validate_dynamic_batching_args",
]


class DynamicBatchingArgs(TypedDict):
    """Settings for token-budget micro batching (pass to ``shard_by_batch_size``).

    Fields:
        input_key: key of the ``[B, S, ...]`` input tensor (e.g. ``"input_ids"``); its
            dim-1 width bounds every sequence length.
        input_lengths_key: key of the per-row real sequence lengths (1-D tensor or list
            of ints, ``len == B``).
        sequence_length_round: every micro batch's padded length is a multiple of this
            (e.g. for tensor/context-parallel alignment or kernel tile sizes).
        max_tokens_per_microbatch: token budget; a micro batch of ``rows`` rows and
            padded length ``L`` satisfies ``rows * L <= max_tokens_per_microbatch``
            unless it is a single row that alone exceeds the budget.
    """

    input_key: str
    input_lengths_key: str
    sequence_length_round: int
    max_tokens_per_microbatch: int


class MicroBatchPlan(NamedTuple):
    """Micro-batch plan for one shard's part of one chunk.

    Attributes:
        indices: ``(start, end)`` row ranges, relative to the start of the chunk's part
            within the shard, contiguous and covering it in order.
        lengths: padded sequence length of each micro batch (same order as ``indices``).
    """

    indices: list[tuple[int, int]]
    lengths: list[int]


class MissingKeyError(KeyError, ValueError):
    """A required key is missing from a batch.

    Subclasses both ``KeyError`` (it *is* a missing key) and ``ValueError`` (it is bad
    input to a function), so callers may catch either.
    """

    def __str__(self) -> str:
        # KeyError.__str__ wraps the message in quotes; keep it readable.
        return str(self.args[0]) if self.args else ""


_INT_FIELDS = ("sequence_length_round", "max_tokens_per_microbatch")
_KEY_FIELDS: tuple[Literal["input_key"], Literal["input_lengths_key"]] = ("input_key", "input_lengths_key")


def validate_dynamic_batching_args(args: Mapping[str, Any]) -> None:
    """Check that ``args`` has every :class:`DynamicBatchingArgs` field with a sane value.

    Raises:
        ValueError: a field is missing, a key field is not a string, or an integer field
            is not a positive ``int``; the message names the field.
    """
    for field in _KEY_FIELDS + _INT_FIELDS:
        if field not in args:
            raise ValueError(f"dynamic_batching_args is missing the field {field!r}")
    for field in _KEY_FIELDS:
        if not isinstance(args[field], str):
            raise ValueError(f"dynamic_batching_args[{field!r}] must be a str, got {args[field]!r}")
    for field in _INT_FIELDS:
        value = args[field]
        # bool is an int subclass; True as a budget is certainly a bug.
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"dynamic_batching_args[{field!r}] must be a positive int, got {value!r}")


def read_sequence_lengths(data: Mapping[str, Any], args: DynamicBatchingArgs) -> list[int]:
    """Return the per-row sequence lengths named by ``args`` as Python ints.

    Checks that ``args["input_key"]`` is a tensor with at least 2 dims and that every
    length lies in ``[0, width]`` where ``width`` is that tensor's dim-1 size: a length
    beyond the width means the lengths and the inputs disagree, and the truncation done
    by the micro-batch iterator would then cut real tokens.

    Raises:
        MissingKeyError: either key is absent from ``data``.
        ValueError: the input tensor or the lengths have the wrong shape or values.
    """
    for field in _KEY_FIELDS:
        key = args[field]
        if key not in data:
            raise MissingKeyError(
                f"dynamic batching {field} {key!r} is not in the batch; available keys: {sorted(data)}"
            )
    inputs = data[args["input_key"]]
    if not torch.is_tensor(inputs) or inputs.ndim < 2:
        raise ValueError(
            f"dynamic batching input_key {args['input_key']!r} must be a tensor of shape "
            f"[batch, seq, ...], got {_describe(inputs)}"
        )
    lengths = _as_int_list(args["input_lengths_key"], data[args["input_lengths_key"]])
    width = inputs.shape[1]
    bad = [n for n in lengths if n < 0 or n > width]
    if bad:
        raise ValueError(
            f"sequence lengths in {args['input_lengths_key']!r} must lie in [0, {width}] "
            f"(dim 1 of {args['input_key']!r}), got {bad[:5]}"
        )
    return lengths


def _as_int_list(key: str, value: Any) -> list[int]:
    """Convert a 1-D integer tensor or a list of ints to ``list[int]``."""
    if torch.is_tensor(value):
        if value.ndim != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(f"sequence lengths {key!r} must be a 1-D integer tensor, got {_describe(value)}")
        return [int(n) for n in value.tolist()]
    if isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        return list(value)
    raise ValueError(f"sequence lengths {key!r} must be a 1-D integer tensor or a list of ints, got {_describe(value)}")


def _describe(value: Any) -> str:
    """Short description of a value for error messages (never its full contents)."""
    if torch.is_tensor(value):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value`` (``multiple > 0``)."""
    return -(-value // multiple) * multiple


def sort_and_deal(lengths: Sequence[int], shards: int) -> list[list[int]]:
    """Sort one chunk's rows by length, longest first, and deal them over ``shards``.

    Row ``i`` of the sorted chunk goes to shard ``i % shards``, so consecutive positions
    of different shards hold rows of nearly the same length: the lockstep plan pads each
    position to the longest of its rows, and dealing keeps that padding small.  Sorting
    longest first puts the largest micro batch first, so out-of-memory problems show up
    on the first step rather than late in a run.  The sort is stable: rows of equal
    length keep their original relative order.

    Args:
        lengths: sequence length of each row of the chunk.
        shards: number of shards (``len(lengths)`` is a multiple of it).

    Returns:
        For each shard, its rows as chunk-relative indices in dealt order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[k::shards] for k in range(shards)]


def plan_lockstep_micro_batches(
    lengths_by_shard: Sequence[Sequence[int]],
    sequence_length_round: int,
    max_tokens_per_microbatch: int,
) -> MicroBatchPlan:
    """Cut equally long per-shard row lists into micro batches shared by all shards.

    Walks positions ``j = 0, 1, ...``.  Position ``j`` needs padded length
    ``max(round_up(lengths_by_shard[k][j], sequence_length_round) for k)``, i.e. the
    maximum over *all* shards, so that one plan fits every shard.  A micro batch's
    padded length is the maximum over its positions.  The current micro batch is closed
    before position ``j`` when ``(rows + 1) * padded_len > max_tokens_per_microbatch``
    with ``padded_len`` including position ``j``.  A single row longer than the budget
    still forms a micro batch of its own (dropping it would silently lose data).

    Because the plan is shared, every shard gets the same number of micro batches, which
    data-parallel ranks need in order to issue the same collectives.

    Args:
        lengths_by_shard: per shard, the real sequence lengths of its rows in order;
            all shards must have the same number of rows.
        sequence_length_round: padded lengths are multiples of this (``> 0``).
        max_tokens_per_microbatch: token budget per micro batch (``> 0``).

    Returns:
        The plan; row ranges are relative to the first row of each shard's list.
    """
    position_lengths = _lockstep_position_lengths(lengths_by_shard, sequence_length_round)
    indices: list[tuple[int, int]] = []
    lengths: list[int] = []
    start, padded_len = 0, 0
    for j, needed in enumerate(position_lengths):
        candidate = max(padded_len, needed)
        rows = j - start
        if rows > 0 and (rows + 1) * candidate > max_tokens_per_microbatch:
            indices.append((start, j))
            lengths.append(padded_len)
            start, candidate = j, needed
        padded_len = candidate
    if start < len(position_lengths):
        indices.append((start, len(position_lengths)))
        lengths.append(padded_len)
    return MicroBatchPlan(indices, lengths)


def _lockstep_position_lengths(lengths_by_shard: Sequence[Sequence[int]], sequence_length_round: int) -> list[int]:
    """Per position, the rounded length of the longest row at that position on any shard."""
    counts = {len(lengths) for lengths in lengths_by_shard}
    if len(counts) > 1:
        raise ValueError(
            "lockstep planning needs the same number of rows on every shard, "
            f"got {[len(lengths) for lengths in lengths_by_shard]}"
        )
    return [round_up(max(position), sequence_length_round) for position in zip(*lengths_by_shard, strict=True)]
