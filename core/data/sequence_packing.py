"""Sequence packing: several sequences per row, so a micro batch carries no padding.

Two halves, both backend-free (numpy index arithmetic the torch and JAX workers share):

* **Planning** (driver side, in ``BatchedDataDict.shard_by_batch_size``): the rows of each
  data-parallel shard are bin-packed by length into micro batches of at most
  ``max_tokens_per_microbatch`` tokens (:func:`pack_bins`), and the shards are given the
  same number of micro batches (:func:`plan_packed_micro_batches`): FSDP ranks that run a
  different number of forward/backward passes hang in a collective.
* **Layout** (worker side): :class:`PackedRow` turns one micro batch of right-padded rows
  into one packed row -- token ids, positions restarting at 0 for every sequence, segment
  ids that confine attention to each sequence -- and maps the packed next-token logprobs
  back onto the caller's ``[rows, width - 1]`` layout, so losses and their normalisation
  see exactly what the unpacked path gives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, get_args

import numpy as np

if TYPE_CHECKING:
    from core.data.shared_prompts import PromptGroup

#: How sequences are binned into packed rows (NeMo RL's names; ``policy.sequence_packing.algorithm``).
PackingAlgorithm = Literal["modified_first_fit_decreasing", "first_fit_decreasing", "concatenative"]

__all__ = [
    "PACKING_ALGORITHMS",
    "SequencePackingArgs",
    "PackedRow",
    "pack_bins",
    "plan_packed_micro_batches",
    "check_packing_budget",
]

#: ``policy.sequence_packing.algorithm`` values (NeMo RL's names), as the config schema types them.
PACKING_ALGORITHMS = get_args(PackingAlgorithm)


class SequencePackingArgs(TypedDict):
    """Settings for packed micro batches (pass to ``shard_by_batch_size``)."""

    input_key: str  # [B, S] token ids
    input_lengths_key: str  # [B] real lengths
    max_tokens_per_microbatch: int  # tokens of one packed row (before rounding up)
    algorithm: str  # one of PACKING_ALGORITHMS
    shared_prompts: NotRequired[bool]  # rows of one prompt hold it once (core.data.shared_prompts)


def check_packing_budget(lengths: Sequence[int], budget: int, field: str) -> None:
    """A sequence longer than the packing budget fits no bin: name the field, row and length."""
    if budget < 1:
        raise ValueError(f"{field} must be a positive number of tokens, got {budget!r}")
    for row, length in enumerate(lengths):
        if length > budget:
            raise ValueError(
                f"{field}={budget} is smaller than sequence {row} (length {length}): every sequence must fit "
                f"one packed row; raise {field} to at least the longest sequence"
            )


# ---------------------------------------------------------------------------------- bins
def pack_bins(lengths: Sequence[int], capacity: int, algorithm: str) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to ``<= capacity``.

    ``first_fit_decreasing``: longest first, each into the first bin with room.
    ``modified_first_fit_decreasing`` (Johnson & Garey): large items (> C/2) open one bin
    each; medium items (C/3, C/2] are added to those bins front to back, small items
    (C/6, C/3] in pairs back to front; what is left goes first-fit-decreasing -- fewer
    bins than FFD on mixes of long and mid-length sequences.  ``concatenative``: in
    order, a new bin whenever the next one does not fit.  Within a bin the indices keep
    ascending order, so a packed row is deterministic.
    """
    check_packing_budget(lengths, capacity, "max_tokens_per_microbatch")
    if algorithm == "first_fit_decreasing":
        bins = _first_fit(_decreasing(lengths, range(len(lengths))), lengths, capacity, [])
    elif algorithm == "modified_first_fit_decreasing":
        bins = _modified_first_fit_decreasing(lengths, capacity)
    elif algorithm == "concatenative":
        bins = _concatenative(lengths, capacity)
    else:
        raise ValueError(f"unknown sequence packing algorithm {algorithm!r}; choose one of {PACKING_ALGORITHMS}")
    return [sorted(b) for b in bins]


def _decreasing(lengths: Sequence[int], items) -> list[int]:
    return sorted(items, key=lambda i: (-lengths[i], i))


def _first_fit(order: list[int], lengths: Sequence[int], capacity: int, bins: list[list[int]]) -> list[list[int]]:
    room = [capacity - sum(lengths[i] for i in b) for b in bins]
    for i in order:
        for k, free in enumerate(room):
            if lengths[i] <= free:
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    c = capacity
    large = _decreasing(lengths, [i for i, n in enumerate(lengths) if n > c / 2])
    medium = _decreasing(lengths, [i for i, n in enumerate(lengths) if c / 3 < n <= c / 2])
    small = _decreasing(lengths, [i for i, n in enumerate(lengths) if c / 6 < n <= c / 3])
    tiny = [i for i, n in enumerate(lengths) if n <= c / 6]
    bins = [[i] for i in large]
    room = [c - lengths[i] for i in large]
    # Medium items, bins front to back: the largest medium item that still fits.
    for k in range(len(bins)):
        fit = next((i for i in medium if lengths[i] <= room[k]), None)
        if fit is not None:
            medium.remove(fit)
            bins[k].append(fit)
            room[k] -= lengths[fit]
    # Small items in pairs, bins back to front (the emptiest bins first): the smallest
    # small item plus the largest one that fits beside it.
    for k in reversed(range(len(bins))):
        if len(bins[k]) > 1 or len(small) < 2:
            continue
        smallest = small[-1]
        if lengths[smallest] + lengths[small[-2]] > room[k]:
            continue
        partner = next(i for i in small[:-1] if lengths[i] + lengths[smallest] <= room[k])
        small.remove(smallest)
        small.remove(partner)
        bins[k] += [partner, smallest]
        room[k] -= lengths[partner] + lengths[smallest]
    rest = _decreasing(lengths, medium + small + tiny)
    return _first_fit(rest, lengths, capacity, bins)


def _concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    used = capacity + 1
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def _split_to(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Split the fullest multi-sequence bins in two until there are ``count`` bins.

    Every shard holds as many rows as the others, so the shard with the most bins has no
    more bins than rows, and any shard can always be split that far."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        k = max((k for k, b in enumerate(bins) if len(b) > 1), key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
        half = len(bins[k]) // 2
        bins[k : k + 1] = [bins[k][:half], bins[k][half:]]
    return bins


def plan_packed_micro_batches(
    lengths_by_shard: Sequence[Sequence[int]], capacity: int, algorithm: str
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per shard ``(row order, micro-batch row ranges)``: the shard's rows reordered so that
    each bin is a contiguous range, with every shard given the same number of bins."""
    binned = [pack_bins(lengths, capacity, algorithm) for lengths in lengths_by_shard]
    count = max((len(b) for b in binned), default=0)
    plans = []
    for lengths, bins in zip(lengths_by_shard, binned, strict=True):
        bins = _split_to(bins, lengths, count)
        order = [i for b in bins for i in b]
        ends = np.cumsum([len(b) for b in bins]).tolist()
        plans.append((order, list(zip([0] + ends[:-1], ends, strict=True))))
    return plans


# ---------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class PackedRow:
    """Index maps between ``rows`` right-padded sequences and one packed row.

    Attributes:
        lengths: ``[rows]`` real lengths; ``starts``: where each row's own segment begins in
            the packed row.
        width: packed width, its tokens rounded up to ``multiple``; the tail is one padding
            segment of its own.
        source: ``[width]`` flat index ``row * source_width + col`` of each packed token
            (0 for the padding tail), ``valid``: ``[width]`` real-token flags.
        positions: ``[width]`` RoPE positions, restarting at 0 for every sequence (a shared
            prompt's samples continue their prompt's positions).
        segments: ``[width]`` segment of each token (the tail's is one past the last).
        prefix_segments: ``[width]`` the segment a token reads besides its own: a sample's
            shared prompt (``core.data.shared_prompts``), else the token's own segment.
        shared: ``[rows]`` leading tokens of each row held once for its group (0: none), read
            from the segment starting at ``prefix_starts[row]``.
    """

    lengths: np.ndarray
    starts: np.ndarray
    source_width: int
    width: int
    source: np.ndarray
    valid: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    prefix_segments: np.ndarray
    shared: np.ndarray
    prefix_starts: np.ndarray

    @classmethod
    def build(
        cls,
        lengths: Sequence[int] | np.ndarray,
        source_width: int,
        multiple: int = 1,
        groups: Sequence[PromptGroup] = (),
    ) -> PackedRow:
        """Pack every row as its own segment, except the rows of each of ``groups``: one
        segment of their shared tokens, then one per row of the rest (``core.data.shared_prompts``)."""
        lens = np.asarray(lengths, dtype=np.int64)
        if lens.ndim != 1 or (lens < 0).any() or (lens > source_width).any():
            raise ValueError(f"PackedRow: lengths {lens.tolist()} must lie in [0, {source_width}]")
        rows = len(lens)
        shared = np.zeros(rows, np.int64)
        head = np.arange(rows)  # the row whose tokens hold each row's shared prefix
        for g in groups:
            if not 0 <= g.start < g.end <= rows or g.shared < 1 or (lens[g.start : g.end] <= g.shared).any():
                raise ValueError(
                    f"PackedRow: group of rows [{g.start}, {g.end}) sharing {g.shared} tokens does not fit rows of "
                    f"lengths {lens.tolist()} (each row needs a token of its own)"
                )
            if (shared[g.start : g.end] > 0).any():
                raise ValueError(f"PackedRow: group of rows [{g.start}, {g.end}) overlaps another group")
            shared[g.start : g.end], head[g.start : g.end] = g.shared, g.start
        # (row, first column, token count, segment read besides its own) of each segment in order
        pieces: list[tuple[int, int, int, int]] = []
        starts, prefix_starts = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        group_piece: dict[int, int] = {}  # a group's first row -> its shared segment
        cursor = 0
        for i in range(rows):
            n_shared = int(shared[i])
            if n_shared and head[i] == i:
                group_piece[i] = len(pieces)
                pieces.append((i, 0, n_shared, len(pieces)))
                prefix_starts[i] = cursor
                cursor += n_shared
            if n_shared:
                prefix_starts[i] = prefix_starts[head[i]]
            starts[i] = cursor
            reads = group_piece[int(head[i])] if n_shared else len(pieces)
            pieces.append((i, n_shared, int(lens[i]) - n_shared, reads))
            cursor += int(lens[i]) - n_shared
        total = cursor
        width = max(-(-total // multiple) * multiple, multiple)
        counts = np.asarray([n for _, _, n, _ in pieces], np.int64)
        seg = np.repeat(np.arange(len(pieces)), counts)
        read_segments = np.repeat(np.asarray([r for *_, r in pieces], np.int64), counts)
        offset = np.concatenate([np.arange(n) for n in counts]) if total else np.zeros(0, np.int64)
        first_col = np.repeat(np.asarray([c for _, c, _, _ in pieces], np.int64), counts)
        row_of = np.repeat(np.asarray([r for r, *_ in pieces], np.int64), counts)
        positions = first_col + offset
        tail = width - total
        return cls(
            lengths=lens,
            starts=starts,
            source_width=source_width,
            width=width,
            source=np.concatenate([row_of * source_width + positions, np.zeros(tail, np.int64)]).astype(np.int64),
            valid=np.concatenate([np.ones(total, bool), np.zeros(tail, bool)]),
            positions=np.concatenate([positions, np.arange(tail)]).astype(np.int64),
            segments=np.concatenate([seg, np.full(tail, len(pieces))]).astype(np.int64),
            prefix_segments=np.concatenate([read_segments, np.full(tail, len(pieces))]).astype(np.int64),
            shared=shared,
            prefix_starts=prefix_starts,
        )

    @property
    def tokens(self) -> int:
        """Real tokens in the packed row."""
        return int(self.valid.sum())

    @property
    def attention_reach(self) -> int:
        """How far back a real token's keys go: the largest ``column - first column it reads``
        (its own segment's start, or its shared prompt's): an attention kernel that reads a
        band of keys behind each query needs no wider band."""
        if not self.valid.any():
            return 0
        # Segments are numbered 0, 1, ... in column order: each one's first column.
        starts = np.searchsorted(self.segments, np.arange(int(self.segments[-1]) + 1))
        cols = np.flatnonzero(self.valid)
        reads_from = np.minimum(starts[self.segments[cols]], starts[self.prefix_segments[cols]])
        return int((cols - reads_from).max())

    def pack(self, tokens: Any) -> Any:
        """``[rows, source_width]`` token ids (numpy, torch or jax) -> ``[1, width]``."""
        flat = tokens.reshape(-1)[self.source]
        return (flat * _like(flat, self.valid))[None]

    def unpack_index(self) -> tuple[np.ndarray, np.ndarray]:
        """``([rows, source_width - 1]`` index into the packed next-token logprobs,
        its validity mask)``: entry ``(i, t)`` is log p(token t+1 | tokens <= t) of row i."""
        return self._row_index(self.source_width - 1, self.lengths - 1)

    def token_index(self) -> tuple[np.ndarray, np.ndarray]:
        """``([rows, source_width]`` index of each row's token in the packed row, its validity
        mask)``: per-token values of the packed forward (router logits) back on the rows."""
        return self._row_index(self.source_width, self.lengths)

    def _row_index(self, width: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # A row's token t lies in its group's shared segment while t < shared, else in its own
        # segment (whose first token is the row's token ``shared``).  The prediction at the
        # shared segment's last token scores the first token of the group's first row -- the
        # prompt's last token, the same in every row of the group.
        t = np.arange(width)[None, :]
        valid = t < counts[:, None]
        shared = self.shared[:, None]
        index = np.where(t < shared, self.prefix_starts[:, None] + t, self.starts[:, None] + t - shared)
        return np.where(valid, index, 0), valid

    def unpack_next_logprobs(self, packed_next: Any) -> Any:
        """``[1, width - 1]`` (or ``[width - 1]``) packed next-token logprobs -> the rows'
        ``[rows, source_width - 1]`` layout, 0 past each row's last prediction."""
        index, valid = self.unpack_index()
        flat = packed_next.reshape(-1)[index]
        return flat * _like(flat, valid)


def _like(x: Any, mask: np.ndarray) -> Any:
    """``mask`` as an array of ``x``'s kind, dtype and device (numpy, torch or jax)."""
    if type(x).__module__.startswith("torch"):
        import torch

        # From pinned memory without blocking: a plain host->GPU copy would make the host wait
        # once per packed micro batch.
        host = torch.from_numpy(np.ascontiguousarray(mask))
        if x.device.type == "cuda":
            return host.pin_memory().to(x.device, non_blocking=True).to(x.dtype)
        return host.to(x.device).to(x.dtype)
    return mask.astype(x.dtype)  # numpy and jax (ml_dtypes covers bfloat16)
