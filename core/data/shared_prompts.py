"""Shared-prompt packing: the rows of one prompt's group hold a single copy of the prompt.

A GRPO batch holds every prompt once per sample, next to each other, and with short
completions most of every row is prompt (the reasoning-gym recipe: ~45 prompt tokens, <= 9
generated).  ``policy.sequence_packing.shared_prompts`` packs such a group as

    [prompt[:-1]] [prompt[-1], completion_1] ... [prompt[-1], completion_G]

one segment each, every completion's segment also reading the prompt's segment
(``PackedRow.prefix_segments``; the mask is ``core.data.context_parallel.attention_allowed``)
and its positions continuing the prompt's.  A token's keys and values depend only on the
tokens before it, and those are the same in every row of the group, so every logit a loss
reads -- and every gradient -- is the unshared one up to float summation order; the
projections and MLP run over the prompt once instead of G times.  The prompt's last token is
repeated in each sample's segment because its logits score each sample's own first token
(the packed layout scores column ``t`` against column ``t + 1``).

The prompt of a row is what comes before its first trained token (``token_mask``), so the
groups are found from the batch itself (:func:`prompt_groups`): adjacent rows whose prompts
are the same tokens.  The driver's planner keeps each group in one micro batch
(:func:`plan_shared_prompt_micro_batches`), and the workers rebuild the groups of each
micro batch from its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.data.sequence_packing import pack_bins, plan_packed_micro_batches

__all__ = [
    "PromptGroup",
    "PackingUnit",
    "prompt_lengths",
    "prompt_groups",
    "packing_units",
    "packed_tokens",
    "plan_shared_prompt_micro_batches",
]


@dataclass(frozen=True)
class PromptGroup:
    """Rows ``[start, end)`` (at least two) share their first ``shared`` tokens: their prompt
    but its last token."""

    start: int
    end: int
    shared: int


@dataclass(frozen=True)
class PackingUnit:
    """Rows ``[start, end)`` binned together: one row (``shared`` 0) or a run of one group's
    rows; ``tokens`` is what they take in a packed row."""

    start: int
    end: int
    shared: int
    tokens: int


def _host(x: Any) -> np.ndarray:
    """``x`` (numpy, torch or jax, on any device) as a numpy array."""
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def prompt_lengths(input_lengths: Any, token_mask: Any) -> np.ndarray:
    """``[rows]`` tokens before each row's first trained token (``token_mask`` > 0); a row
    with none trained is all prompt."""
    lens = _host(input_lengths).astype(np.int64)
    mask = _host(token_mask) > 0
    if mask.ndim != 2 or mask.shape[0] != lens.shape[0]:
        raise ValueError(f"token_mask of shape {tuple(mask.shape)} does not match {lens.shape[0]} rows")
    first = np.where(mask.any(axis=1), mask.argmax(axis=1), lens)
    return np.minimum(first, lens)


def prompt_groups(input_ids: Any, input_lengths: Any, token_mask: Any) -> list[PromptGroup]:
    """The runs of adjacent rows (two or more) whose prompts are the same tokens, in row order.

    A prompt of one token shares nothing (its one token is repeated in every segment)."""
    ids = _host(input_ids)
    prompts = prompt_lengths(input_lengths, token_mask)
    groups: list[PromptGroup] = []
    start = 0
    for i in range(1, len(prompts) + 1):
        p = int(prompts[start])
        if i < len(prompts) and p >= 2 and prompts[i] == p and np.array_equal(ids[i, :p], ids[start, :p]):
            continue
        if i - start >= 2 and p >= 2:
            groups.append(PromptGroup(start, i, p - 1))
        start = i
    return groups


def packed_tokens(lengths: Sequence[int] | np.ndarray, shared: int) -> int:
    """Tokens of rows ``lengths`` packed with their first ``shared`` tokens held once."""
    return shared + sum(int(n) - shared for n in lengths)


def packing_units(
    lengths: Sequence[int] | np.ndarray, groups: Sequence[PromptGroup], capacity: int | None = None
) -> list[PackingUnit]:
    """Every row in exactly one unit, in row order: each group cut into consecutive runs whose
    packed tokens fit ``capacity`` (a run of one row is a plain row), every other row alone."""
    lens = [int(n) for n in lengths]
    units: list[PackingUnit] = []
    row = 0
    for group in [*groups, PromptGroup(len(lens), len(lens), 0)]:
        units += [PackingUnit(i, i + 1, 0, lens[i]) for i in range(row, group.start)]
        start = group.start
        while start < group.end:
            end = start + 1
            while end < group.end and (
                capacity is None or packed_tokens(lens[start : end + 1], group.shared) <= capacity
            ):
                end += 1
            shared = group.shared if end - start >= 2 else 0
            units.append(PackingUnit(start, end, shared, packed_tokens(lens[start:end], shared)))
            start = end
        row = group.end
    return units


def plan_shared_prompt_micro_batches(
    shards: Sequence[tuple[Sequence[int], Sequence[PromptGroup]]], capacity: int, algorithm: str
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """``plan_packed_micro_batches`` over units: per shard ``(row order, micro-batch row
    ranges)`` for its rows' ``(lengths, prompt groups)``, every group's rows in one micro batch
    (a group too large for one is cut into runs that fit), every shard given the same number.

    Shards must run as many micro batches as each other (lockstep collectives), and a shard
    can only be given more by splitting a unit: a shard with fewer units than the others'
    micro batches has its largest units halved (each half still sharing its prompt) first."""
    lengths = [[int(n) for n in lens] for lens, _ in shards]
    units = [packing_units(lens, groups, capacity) for lens, (_, groups) in zip(lengths, shards, strict=True)]
    while True:
        count = max((len(pack_bins([u.tokens for u in shard], capacity, algorithm)) for shard in units), default=0)
        short = [k for k, shard in enumerate(units) if len(shard) < count]
        if not short:
            break
        for k in short:
            units[k] = _halve_units(units[k], lengths[k], count)
    plans = plan_packed_micro_batches([[u.tokens for u in shard] for shard in units], capacity, algorithm)
    out = []
    for shard_units, (unit_order, unit_bins) in zip(units, plans, strict=True):
        ordered = [shard_units[i] for i in unit_order]
        order = [row for u in ordered for row in range(u.start, u.end)]
        ends = np.cumsum([0] + [u.end - u.start for u in ordered]).tolist()
        out.append((order, [(ends[a], ends[b]) for a, b in unit_bins]))
    return out


def _halve_units(units: list[PackingUnit], lengths: list[int], count: int) -> list[PackingUnit]:
    """Halve the units of the most rows until there are ``count`` (there are at least as many
    rows: every shard has as many rows as the others, and no shard more bins than rows)."""
    units = list(units)
    while len(units) < count:
        k = max(range(len(units)), key=lambda k: (units[k].end - units[k].start, -k))
        u = units[k]
        mid = u.start + (u.end - u.start) // 2
        halves = []
        for a, b in ((u.start, mid), (mid, u.end)):
            shared = u.shared if b - a >= 2 else 0
            halves.append(PackingUnit(a, b, shared, packed_tokens(lengths[a:b], shared)))
        units[k : k + 1] = halves
    return units
