"""Per-rank batch plumbing shared by the torch workers: micro batches, model inputs, counts,
the packed / context-parallel row layouts.

All of it is the same for FSDP1 and DTensor; what differs per backend (how logits are
produced, whether they are vocab-sharded) stays in the workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from core.data import BatchedDataDict
from core.data.context_parallel import row_segments
from core.data.sequence_packing import PackedRow
from core.data.shared_prompts import prompt_groups


def micro_batches(batch: BatchedDataDict, micro_batch_size: int) -> Iterator[BatchedDataDict]:
    """The micro batches of ``batch``: the attached dynamic-batching plan if there is one
    (token-budget micro batches, lockstep over ranks), else fixed ``micro_batch_size`` rows."""
    if getattr(batch, "micro_batch_indices", None) is not None:
        return batch.make_microbatch_iterator_with_dynamic_shapes()
    return batch.make_microbatch_iterator(micro_batch_size)


def model_inputs(
    mb: BatchedDataDict, device: torch.device | str, seq_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, seq_len)`` for one right-padded micro batch.

    The width is padded up to a multiple of ``seq_multiple`` (sequence parallelism splits
    the sequence over the TP ranks) with masked-out pad columns; ``seq_len`` is the width
    before padding, so callers can cut outputs back.
    """
    ids = mb["input_ids"]
    lengths = mb["input_lengths"]
    seq_len = ids.shape[1]
    width = -(-seq_len // seq_multiple) * seq_multiple
    if width != seq_len:
        ids = torch.nn.functional.pad(ids, (0, width - seq_len), value=0)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return to_device(ids, device), to_device(mask, device), seq_len


def packed_layout(mb: BatchedDataDict, seq_multiple: int = 1, shared_prompts: bool = False) -> PackedRow:
    """The packing layout of a micro batch: one packed row of its sequences, and with
    ``shared_prompts`` one copy of each group's prompt (``core.data.shared_prompts``)."""
    lengths = mb["input_lengths"]
    groups = prompt_groups(mb["input_ids"], lengths, mb["token_mask"]) if shared_prompts and "token_mask" in mb else ()
    return PackedRow.build(lengths.tolist(), mb["input_ids"].shape[1], seq_multiple, groups)


def reshaped_rows(
    mb: BatchedDataDict, packed: bool, seq_multiple: int = 1, shared_prompts: bool = False
) -> tuple[PackedRow | None, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """``(packing layout or None, input_ids, positions, segments, prefix segments)`` on the
    host for a micro batch that leaves the plain padded layout: packed into one row of
    several sequences (positions restarting at 0, segments confining attention to each
    sequence, a shared prompt read by its samples), or -- for context parallelism -- its
    right-padded rows with explicit positions and segments."""
    lengths = mb["input_lengths"]
    if packed:
        layout = packed_layout(mb, seq_multiple, shared_prompts)
        positions = torch.from_numpy(layout.positions)[None]
        return layout, layout.pack(mb["input_ids"]), positions, layout.segments[None], layout.prefix_segments[None]
    ids, _, _ = model_inputs(mb, "cpu", seq_multiple)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    segments = row_segments(lengths.tolist(), ids.shape[1])
    return None, ids, positions, segments, segments


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait for the device.

    A plain ``.to("cuda")`` of host memory returns only after the copy ran, and the copy is
    queued behind all earlier work on the stream (a non-blocking copy of pageable memory
    may stage synchronously too): inside a micro-batch loop that drains the pipeline once
    per micro batch.  A non-blocking copy from pinned memory does not wait; torch's pinned-
    memory allocator keeps the staging buffer alive until the copy has run.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def batch_to_device(mb: BatchedDataDict, device: torch.device) -> BatchedDataDict:
    """A device copy of ``mb`` (lists kept), without waiting for the copies (``to_device``)."""
    if device.type == "cpu":
        return mb
    return BatchedDataDict({k: to_device(v, device) if torch.is_tensor(v) else v for k, v in mb.items()})


def global_valid_counts(
    gb: BatchedDataDict, device: torch.device, dp_group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid sequences, valid next-token positions) of the *global* batch.

    Summed over the data-parallel group so every rank normalises its micro-batch losses by
    the same global counts: the sum of all micro-batch losses over all ranks is then the
    loss of the whole batch, whatever the micro-batch size or the number of ranks.
    """
    sample_mask = gb["sample_mask"].to(torch.float64)
    if "token_mask" in gb:
        tokens = (gb["token_mask"][:, 1:].to(torch.float64) * sample_mask[:, None]).sum()
    else:
        tokens = (
            (torch.arange(gb["input_ids"].shape[1] - 1)[None, :] < (gb["input_lengths"][:, None] - 1)).to(torch.float64)
            * sample_mask[:, None]
        ).sum()
    counts = torch.stack([sample_mask.sum(), tokens]).to(device)
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return counts[0].to(torch.float32), counts[1].to(torch.float32)


def pad_columns(t: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad dim 1 of ``t`` to ``width``."""
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
