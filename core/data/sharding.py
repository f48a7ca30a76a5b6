"""Which rows of a batch go to which data-parallel shard, and the micro-batch plan each gets.

The row arithmetic behind :meth:`core.data.BatchedDataDict.shard_by_batch_size` (see its
docstring for the semantics), free of any container: every function here returns row
indices and plans, and the batch slices itself by them.

* :func:`resolve_chunk_size` -- validates the call's arguments, returns the chunk size;
* :func:`contiguous_shard_rows` -- plain sharding: part ``k`` of every chunk goes to shard ``k``;
* :func:`dynamic_shard_plan` -- each chunk sorted by length and dealt round-robin, with one
  token-budget micro-batch plan shared by every shard (``core.data.dynamic_batching``);
* :func:`packed_shard_plan` -- dealt the same way, then each shard's rows bin-packed and
  reordered so every bin is one contiguous micro batch (``core.data.sequence_packing``);
  with shared prompts whole prompt groups are dealt and binned (``core.data.shared_prompts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from core.data.dynamic_batching import (
    DynamicBatchingArgs,
    MicroBatchPlan,
    plan_lockstep_micro_batches,
    read_sequence_lengths,
    sort_and_deal,
    validate_dynamic_batching_args,
)
from core.data.sequence_packing import SequencePackingArgs, plan_packed_micro_batches
from core.data.shared_prompts import packing_units, plan_shared_prompt_micro_batches, prompt_groups

__all__ = [
    "ShardPlan",
    "resolve_chunk_size",
    "contiguous_shard_rows",
    "dynamic_shard_plan",
    "packed_shard_plan",
]


class ShardPlan(NamedTuple):
    """Each shard's rows and micro-batch plan, one list entry per shard.

    Attributes:
        rows: the shard's rows of the batch, in the shard's order.
        micro_batch_indices: per chunk, ``(start, end)`` row ranges relative to the
            chunk's first row within the shard (``BatchedDataDict.micro_batch_indices``).
        micro_batch_lengths: per chunk, each micro batch's padded length.
    """

    rows: list[list[int]]
    micro_batch_indices: list[list[list[tuple[int, int]]]]
    micro_batch_lengths: list[list[list[int]]]


def resolve_chunk_size(total: int, shards: int, batch_size: int | None, allow_uneven: bool, dynamic: bool) -> int:
    """Validate ``shard_by_batch_size`` arguments and return the chunk size."""
    if shards <= 0:
        raise ValueError(f"shards must be positive, got {shards}")
    if allow_uneven and batch_size is not None:
        raise ValueError("allow_uneven_shards=True requires batch_size=None")
    if allow_uneven and dynamic:
        # Lockstep plans need equally many rows per shard, or short shards would get
        # empty micro batches.
        raise ValueError("allow_uneven_shards=True cannot be combined with dynamic_batching_args")
    if batch_size is None:
        batch_size = total
    elif batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    elif total % batch_size:
        raise ValueError(f"total batch size {total} is not divisible by batch_size {batch_size}")
    if not allow_uneven and batch_size % shards:
        raise ValueError(
            f"batch size {batch_size} is not divisible by shards={shards}; pass "
            "allow_uneven_shards=True (with batch_size=None) to allow uneven shards"
        )
    return batch_size


def contiguous_shard_rows(total: int, shards: int, batch_size: int, allow_uneven: bool) -> list[list[int]]:
    """Rows of each shard: part ``k`` of every chunk of ``batch_size`` rows, in order."""
    part = -(-batch_size // shards) if allow_uneven else batch_size // shards
    rows: list[list[int]] = [[] for _ in range(shards)]
    # An empty batch has no chunks (and batch_size 0): every shard stays empty.
    for chunk_start in range(0, total, max(batch_size, 1)):
        chunk_end = chunk_start + batch_size
        for k in range(shards):
            start = min(chunk_start + k * part, chunk_end)
            rows[k].extend(range(start, min(start + part, chunk_end)))
    return rows


def dynamic_shard_plan(data: Mapping[str, Any], shards: int, batch_size: int, args: DynamicBatchingArgs) -> ShardPlan:
    """Dynamic batching: per chunk of ``batch_size`` rows, the rows sorted by length and
    dealt round-robin, and one lockstep plan for all shards (arguments already checked
    except ``args``)."""
    validate_dynamic_batching_args(args)
    lengths = read_sequence_lengths(data, args)
    shard_rows: list[list[int]] = [[] for _ in range(shards)]
    plans: list[MicroBatchPlan] = []
    # max(..., 1): an empty batch has batch_size 0 and no chunks.
    for chunk_start in range(0, len(lengths), max(batch_size, 1)):
        chunk_lengths = lengths[chunk_start : chunk_start + batch_size]
        dealt = sort_and_deal(chunk_lengths, shards)
        plans.append(
            plan_lockstep_micro_batches(
                [[chunk_lengths[i] for i in part] for part in dealt],
                args["sequence_length_round"],
                args["max_tokens_per_microbatch"],
            )
        )
        for rows, part in zip(shard_rows, dealt, strict=True):
            rows.extend(chunk_start + i for i in part)
    # Copies per shard: plans must not alias across shards living in one process.
    return ShardPlan(
        shard_rows,
        [[list(plan.indices) for plan in plans] for _ in range(shards)],
        [[list(plan.lengths) for plan in plans] for _ in range(shards)],
    )


def packed_shard_plan(data: Mapping[str, Any], shards: int, batch_size: int, args: SequencePackingArgs) -> ShardPlan:
    """Sequence packing: per chunk, the rows sorted and dealt as with dynamic batching, then
    each shard's part bin-packed; every bin is a contiguous range of the shard's rows."""
    lengths = read_sequence_lengths(
        data,
        DynamicBatchingArgs(
            input_key=args["input_key"],
            input_lengths_key=args["input_lengths_key"],
            sequence_length_round=1,
            max_tokens_per_microbatch=args["max_tokens_per_microbatch"],
        ),
    )
    shard_rows: list[list[int]] = [[] for _ in range(shards)]
    ranges: list[list[list[tuple[int, int]]]] = [[] for _ in range(shards)]
    widths: list[list[list[int]]] = [[] for _ in range(shards)]
    shared = bool(args.get("shared_prompts")) and "token_mask" in data
    for chunk_start in range(0, len(lengths), max(batch_size, 1)):
        chunk_lengths = lengths[chunk_start : chunk_start + batch_size]
        if shared:
            dealt, plans = _shared_prompt_plans(data, chunk_start, chunk_lengths, shards, args)
        else:
            dealt = sort_and_deal(chunk_lengths, shards)
            plans = plan_packed_micro_batches(
                [[chunk_lengths[i] for i in part] for part in dealt],
                args["max_tokens_per_microbatch"],
                args["algorithm"],
            )
        for k, (part, (order, bins)) in enumerate(zip(dealt, plans, strict=True)):
            rows = [part[i] for i in order]
            shard_rows[k].extend(chunk_start + i for i in rows)
            ranges[k].append(bins)
            # A bin's tensors keep the width of its longest row (the worker packs them).
            widths[k].append([max(chunk_lengths[rows[i]] for i in range(a, b)) for a, b in bins])
    return ShardPlan(shard_rows, ranges, widths)


def _shared_prompt_plans(
    data: Mapping[str, Any], chunk_start: int, lengths: list[int], shards: int, args: SequencePackingArgs
) -> tuple[list[list[int]], list[tuple[list[int], list[tuple[int, int]]]]]:
    """Shared-prompt packing of one chunk: ``(each shard's chunk rows, its packing plan)``.

    Whole prompt groups are dealt over the shards, largest first, when they split evenly (a
    GRPO batch: every prompt with the same number of samples); otherwise each shard takes a
    contiguous part of the chunk, which keeps the groups inside it together."""
    end = chunk_start + len(lengths)
    ids, mask = data[args["input_key"]][chunk_start:end], data["token_mask"][chunk_start:end]
    budget = args["max_tokens_per_microbatch"]
    units = packing_units(lengths, prompt_groups(ids, lengths, mask), budget)
    sizes = {u.end - u.start for u in units}
    if len(sizes) == 1 and len(units) % shards == 0:
        order = sorted(range(len(units)), key=lambda u: -units[u].tokens)
        dealt = [[r for u in order[k::shards] for r in range(units[u].start, units[u].end)] for k in range(shards)]
    else:
        part = len(lengths) // shards
        dealt = [list(range(k * part, (k + 1) * part)) for k in range(shards)]
    shard_inputs = [
        ([lengths[i] for i in rows], prompt_groups(ids[rows], [lengths[i] for i in rows], mask[rows])) for rows in dealt
    ]
    return dealt, plan_shared_prompt_micro_batches(shard_inputs, budget, args["algorithm"])
