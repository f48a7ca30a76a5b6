"""``BatchedDataDict``: the batch container passed between controller and workers.

A ``BatchedDataDict`` maps string keys to either a ``torch.Tensor`` whose dim 0 is the
batch dimension or a Python ``list`` with one entry per row (strings, message logs, ...).
Every key has the same number of rows.  The semantics mirror NeMo RL's class of the same
name (``nemo_rl.distributed.batched_data_dict``), including ``shard_by_batch_size`` and
token-budget ("dynamic") micro batching; differences are noted in the method docstrings.
Which rows go to which shard, and the micro-batch plans, are computed by
:mod:`core.data.sharding`; this class slices itself by them.

Instances pickle with their attributes (the micro-batch plan included), because they
travel to workers through Ray.
"""

from __future__ import annotations

import operator
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, Generic, Self, TypeVar

import torch
import torch.nn.functional as F

from core.data.dynamic_batching import DynamicBatchingArgs, MissingKeyError
from core.data.sequence_packing import SequencePackingArgs
from core.data.sharding import contiguous_shard_rows, dynamic_shard_plan, packed_shard_plan, resolve_chunk_size

__all__ = ["BatchedDataDict", "SlicedDataDict"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])

Value = torch.Tensor | list
Indices = Sequence[int] | torch.Tensor


class BatchedDataDict(UserDict, Generic[DictT]):
    """A dict of batched values: tensors (dim 0 = batch) or lists (one entry per row).

    ``BatchedDataDict[SomeTypedDict]`` may be used in annotations to document the keys.

    Attributes:
        micro_batch_indices: dynamic-batching plan, ``None`` unless this dict came from
            ``shard_by_batch_size(..., dynamic_batching_args=...)`` (or ``get_batch`` of
            such a shard).  One list per chunk of ``(start, end)`` row ranges, relative
            to the first row of that chunk within this dict.
        micro_batch_lengths: padded sequence length of each planned micro batch, same
            nesting as ``micro_batch_indices``.

    Only ``get_batch``, ``to``, ``truncate_tensors`` and pickling keep the plan; every
    other method builds a new dict whose row positions no longer match it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[tuple[int, int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None

    # ------------------------------------------------------------------ basics

    @property
    def size(self) -> int:
        """Number of rows (0 for an empty dict).

        Raises:
            ValueError: keys disagree on the number of rows; the message names two
                disagreeing keys and their row counts.
            TypeError: a value is neither a tensor with at least 1 dim nor a list.
        """
        first_key, first_rows = None, 0
        for key, value in self.data.items():
            rows = _row_count(key, value)
            if first_key is None:
                first_key, first_rows = key, rows
            elif rows != first_rows:
                raise ValueError(f"batch size mismatch: {first_key!r} has {first_rows} rows, {key!r} has {rows}")
        return first_rows

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` with the same keys and the same value objects (shallow copy)."""
        return dict(self.data)

    def to(self, device: str | torch.device) -> Self:
        """Move every tensor to ``device`` **in place** and return ``self`` (NeMo semantics).

        Lists are left untouched; the micro-batch plan is kept.
        """
        for key, value in self.data.items():
            if torch.is_tensor(value):
                self.data[key] = value.to(device)
        return self

    # ------------------------------------------------------------- combining

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> Self:
        """Concatenate ``batches`` along the batch dimension into one new dict.

        Keys keep the order of the first batch.  Lists are concatenated.  Tensors are
        concatenated on dim 0; tensors with at least 2 dims whose dim-1 sizes differ are
        first right-padded on dim 1 to the largest size with ``pad_value_dict.get(key,
        0)``.  Dims beyond dim 1 must agree, as must dtypes (a silent int -> float
        promotion of token ids would be a bug).  The result carries no micro-batch plan:
        plans of different batches do not compose.

        Args:
            batches: dicts (``BatchedDataDict`` or plain) with identical key sets.
            pad_value_dict: per-key padding value, default 0.

        Returns:
            A new ``cls``; an empty one if ``batches`` is empty.

        Raises:
            MissingKeyError: a key is missing from some batch (the message names it).
            ValueError: a key mixes tensors and lists, or its tensors disagree in rank,
                trailing dims or dtype.
        """
        merged = cls()
        if not batches:
            return merged
        pad_values = pad_value_dict or {}
        _check_same_keys(batches)
        for key in batches[0]:
            values = [batch[key] for batch in batches]
            merged[key] = _concat_values(key, values, pad_values.get(key, 0))
        return merged

    def all_gather(self, group: torch.distributed.ProcessGroup | None = None) -> Self:
        """Gather every rank's dict of ``group`` and merge them in rank order.

        Collective: every rank of ``group`` must call it.  Ranks may hold different
        numbers of rows and different dim-1 widths; merging follows ``from_batches``
        (right-padding with 0).  Tensors are sent through CPU, because an unpickled CUDA
        tensor would land on the *sender's* device index; each gathered tensor is moved
        back to the device of this rank's tensor for that key.

        Args:
            group: process group; ``None`` means the default group.

        Returns:
            A new dict of the same class with the rows of rank 0, then rank 1, ...
        """
        payload = {key: value.cpu() if torch.is_tensor(value) else value for key, value in self.data.items()}
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, payload, group=group)
        merged = type(self).from_batches(gathered)
        for key, value in self.data.items():
            if torch.is_tensor(value):
                merged[key] = merged[key].to(value.device)
        return merged

    # ------------------------------------------------------- row selection

    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Rows ``[start, end)`` as a new ``SlicedDataDict`` without a plan.

        Tensors are views of this dict's tensors (no copy); lists are new lists.

        Raises:
            IndexError: unless ``0 <= start <= end <= size``.
        """
        size = self.size
        if not 0 <= start <= end <= size:
            raise IndexError(f"slice [{start}, {end}) is out of range for a batch of {size} rows")
        return SlicedDataDict({key: value[start:end] for key, value in self.data.items()})

    def select_indices(self, indices: Indices) -> Self:
        """New dict (same class, no plan) with the rows at ``indices``, in that order.

        Gather semantics: ``result[i] == self[indices[i]]``.  Indices may repeat.
        Tensors are copied (``index_select``).

        Args:
            indices: sequence or 1-D integer tensor of row indices in ``[0, size)``.

        Raises:
            IndexError: an index is out of range.
            TypeError: ``indices`` is not integer-valued (e.g. a boolean mask).
        """
        rows = _normalize_indices(indices, self.size)
        return type(self)({key: _gather_rows(value, rows) for key, value in self.data.items()})

    def reorder_data(self, indices: Indices) -> Self:
        """New dict (same class, no plan) with row ``i`` moved to position ``indices[i]``.

        Scatter semantics, the inverse of ``select_indices``:
        ``result[indices[i]] == self[i]``.  This is what undoes the row permutation of
        dynamic-batching ``shard_by_batch_size``: pass it the returned
        ``sorted_indices``.  Unlike NeMo RL (which reorders in place), ``self`` is left
        unchanged and the reordered dict is returned.

        Raises:
            ValueError: ``indices`` is not a permutation of ``range(size)``.
        """
        size = self.size
        targets = _normalize_indices(indices, size)
        if sorted(targets) != list(range(size)):
            raise ValueError(
                f"reorder_data needs a permutation of range({size}), got {len(targets)} indices that are not one"
            )
        sources = [0] * size
        for source, target in enumerate(targets):
            sources[target] = source
        return self.select_indices(sources)

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """The ``rank``-th of ``chunks`` equal contiguous parts, e.g. rows
        ``[A A B B C C]``, ``rank=1``, ``chunks=3`` -> ``[B B]``.

        Raises:
            ValueError: ``chunks <= 0``, ``rank`` not in ``[0, chunks)``, or the batch
                size is not divisible by ``chunks`` (uneven replicas would desync).
        """
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        if not 0 <= rank < chunks:
            raise ValueError(f"rank must be in [0, {chunks}), got {rank}")
        size = self.size
        if size % chunks:
            raise ValueError(f"batch size {size} is not divisible by chunks={chunks}")
        part = size // chunks
        return self.slice(rank * part, (rank + 1) * part)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """Rows ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``.

        If this dict carries a dynamic-batching plan, chunk ``batch_idx`` of that plan is
        attached to the result (as its only chunk), so the result can be iterated with
        ``make_microbatch_iterator_with_dynamic_shapes``.  ``batch_size`` must then be the
        per-shard chunk size the plan was made for (``shard_by_batch_size``'s
        ``batch_size // shards``); ``None`` takes it from the plan.

        Raises:
            ValueError: ``batch_size`` is missing/non-positive without a plan, or
                disagrees with the plan.
            IndexError: the requested rows are out of range.
        """
        if self.micro_batch_indices is None:
            if batch_size is None or batch_size <= 0:
                raise ValueError(f"batch_size must be a positive int, got {batch_size}")
            return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        start, end = self._plan_chunk_rows(batch_idx)
        if batch_size is not None and batch_size != end - start:
            raise ValueError(
                f"batch_size={batch_size} does not match the dynamic-batching plan, whose "
                f"chunk {batch_idx} has {end - start} rows"
            )
        indices, lengths = self._require_plan()
        batch = self.slice(start, end)
        batch.micro_batch_indices = [list(indices[batch_idx])]
        batch.micro_batch_lengths = [list(lengths[batch_idx])]
        return batch

    # --------------------------------------------------------- transforms

    def repeat_interleave(self, num_repeats: int) -> Self:
        """New dict (same class, no plan) with each row repeated ``num_repeats`` times
        consecutively: rows ``[a, b]`` -> ``[a, a, b, b]`` for ``num_repeats=2``.

        List entries are deep-copied so repeated rows (e.g. message logs that are later
        extended per sample) do not alias each other.

        Raises:
            ValueError: ``num_repeats <= 0``.
        """
        if num_repeats <= 0:
            raise ValueError(f"num_repeats must be positive, got {num_repeats}")
        repeated = type(self)()
        for key, value in self.data.items():
            if torch.is_tensor(value):
                repeated[key] = value.repeat_interleave(num_repeats, dim=0)
            else:
                repeated[key] = [deepcopy(x) for x in value for _ in range(num_repeats)]
        return repeated

    def truncate_tensors(self, dim: int, truncated_len: int) -> Self:
        """Keep the first ``truncated_len`` entries along ``dim`` of every tensor with
        more than ``dim`` dims, **in place**; returns ``self``.

        Tensors already shorter than ``truncated_len`` keep their size; tensors with too
        few dims and lists are untouched.  The new tensors are views.

        Raises:
            ValueError: ``dim < 0`` or ``truncated_len < 0``.
        """
        if dim < 0 or truncated_len < 0:
            raise ValueError(f"dim and truncated_len must be non-negative, got {dim} and {truncated_len}")
        for key, value in self.data.items():
            if torch.is_tensor(value) and value.ndim > dim:
                length = min(truncated_len, value.shape[dim])
                self.data[key] = value.narrow(dim, 0, length)
        return self

    # ------------------------------------------------------------ sharding

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[SlicedDataDict] | tuple[list[SlicedDataDict], list[int]]:
        """Split the batch over ``shards`` data-parallel ranks (NeMo RL semantics).

        The rows are cut into consecutive chunks of ``batch_size`` rows (``None``: one
        chunk holding everything).  Each chunk is divided into ``shards`` equal
        contiguous parts, and shard ``k`` is part ``k`` of chunk 0, then part ``k`` of
        chunk 1, ...  With ``batch_size`` = global batch size, every optimizer step
        (one chunk) thus draws from every shard.  Examples with rows ``[0 0 1 1 2 2 3 3]``
        and ``shards=2``: ``batch_size=None`` -> ``[0 0 1 1] / [2 2 3 3]``;
        ``batch_size=4`` -> ``[0 0 2 2] / [1 1 3 3]``.

        ``allow_uneven_shards`` (only with ``batch_size=None``) gives every shard
        ``ceil(size / shards)`` rows except the last non-empty one, which gets the rest
        (later shards may be empty): ``[0 1 2 3 4]`` -> ``[0 1 2] / [3 4]``.

        With ``dynamic_batching_args`` the rows of each chunk are instead sorted by
        length (longest first) and dealt round-robin (sorted row ``i`` -> shard
        ``i % shards``), and a micro-batch plan shared by all shards (see
        ``core.data.dynamic_batching.plan_lockstep_micro_batches``) is attached to each
        shard, one plan entry per chunk.  Rows are therefore permuted, and the call
        returns ``(shards, sorted_indices)``: ``sorted_indices[i]`` is the original row
        of row ``i`` of the concatenation ``shard 0 + shard 1 + ...`` (each shard in its
        own row order).  ``from_batches(results_per_shard).reorder_data(sorted_indices)``
        restores the original row order.

        Args:
            shards: number of shards, ``> 0``.
            batch_size: chunk size; must divide the batch size and be divisible by
                ``shards``.
            allow_uneven_shards: allow a batch size not divisible by ``shards``.
            dynamic_batching_args: enables token-budget micro batching.
            sequence_packing_args: enables packed micro batches: rows are sorted and
                dealt as with dynamic batching, then each shard's rows are bin-packed
                (``core.data.sequence_packing``) and reordered so that every bin is one
                contiguous micro batch; all shards get the same number of bins.  The
                return value is ``(shards, sorted_indices)`` as with dynamic batching.

        Returns:
            ``list[SlicedDataDict]`` of length ``shards``, or with dynamic batching
            ``(list[SlicedDataDict], sorted_indices)``.

        Raises:
            ValueError: invalid ``shards``/``batch_size``/``allow_uneven_shards``
                combinations or dynamic-batching arguments (the message names them).
        """
        total = self.size
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError("dynamic_batching_args and sequence_packing_args cannot be combined")
        dynamic = dynamic_batching_args is not None or sequence_packing_args is not None
        batch_size = resolve_chunk_size(total, shards, batch_size, allow_uneven_shards, dynamic)
        if sequence_packing_args is not None:
            plan = packed_shard_plan(self.data, shards, batch_size, sequence_packing_args)
        elif dynamic_batching_args is not None:
            plan = dynamic_shard_plan(self.data, shards, batch_size, dynamic_batching_args)
        else:
            rows = contiguous_shard_rows(total, shards, batch_size, allow_uneven_shards)
            return [self._sliced_rows(shard_rows) for shard_rows in rows]
        sliced = [self._sliced_rows(rows) for rows in plan.rows]
        for shard, indices, lengths in zip(sliced, plan.micro_batch_indices, plan.micro_batch_lengths, strict=True):
            shard.micro_batch_indices, shard.micro_batch_lengths = indices, lengths
        return sliced, [row for rows in plan.rows for row in rows]

    def _sliced_rows(self, rows: list[int]) -> SlicedDataDict:
        """The rows ``rows`` (validated, in order) as a ``SlicedDataDict``."""
        return SlicedDataDict({key: _gather_rows(value, rows) for key, value in self.data.items()})

    # --------------------------------------------------------- micro batches

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        """Yield consecutive slices of ``microbatch_size`` rows, in order.

        The last micro batch is shorter when the batch size is not a multiple of
        ``microbatch_size`` (NeMo RL asserts divisibility instead).  An empty batch
        yields nothing.

        Raises:
            ValueError: ``microbatch_size <= 0`` (raised on the call, not on iteration).
        """
        if microbatch_size <= 0:
            raise ValueError(f"microbatch_size must be positive, got {microbatch_size}")
        return self._microbatches(microbatch_size, self.size)

    def _microbatches(self, microbatch_size: int, size: int) -> Iterator[SlicedDataDict]:
        """Generator body of ``make_microbatch_iterator``."""
        for start in range(0, size, microbatch_size):
            yield self.slice(start, min(start + microbatch_size, size))

    def make_microbatch_iterator_with_dynamic_shapes(self, batch_idx: int | None = None) -> Iterator[SlicedDataDict]:
        """Yield the micro batches of the attached dynamic-batching plan, in plan order.

        Each micro batch is a slice of this dict in which every tensor with at least 2
        dims is truncated on dim 1 to the micro batch's padded length (or kept at its
        width when that is smaller).  The padded length is at least every row's real
        length, so no real token is cut.  Tensors are views.

        Args:
            batch_idx: iterate only chunk ``batch_idx`` of the plan; ``None`` iterates
                every chunk in order (after ``get_batch`` there is exactly one).

        Raises:
            ValueError: no plan is attached (raised on the call).
            IndexError: ``batch_idx`` is out of range.
        """
        self._require_plan()
        chunk_ids = self._plan_chunk_ids(batch_idx)
        return self._dynamic_microbatches(chunk_ids)

    def _dynamic_microbatches(self, chunk_ids: list[int]) -> Iterator[SlicedDataDict]:
        """Generator body of ``make_microbatch_iterator_with_dynamic_shapes``."""
        for chunk in chunk_ids:
            for start, end, length in self.planned_micro_batches(chunk):
                yield self.slice(start, end).truncate_tensors(dim=1, truncated_len=length)

    def planned_micro_batches(self, batch_idx: int | None = None) -> list[tuple[int, int, int]]:
        """``(start, end, padded length)`` of each micro batch of the attached dynamic-batching
        plan, rows counted within this dict (chunk ``batch_idx`` only, or every chunk in order).

        Raises:
            ValueError: no plan is attached.
            IndexError: ``batch_idx`` is out of range.
        """
        indices, lengths = self._require_plan()
        out = []
        for chunk in self._plan_chunk_ids(batch_idx):
            offset, _ = self._plan_chunk_rows(chunk)
            out += [(offset + a, offset + b, n) for (a, b), n in zip(indices[chunk], lengths[chunk], strict=True)]
        return out

    def plan_chunk_sizes(self) -> list[int]:
        """Rows of each chunk of the attached plan (``micro_batch_indices``: a dynamic-batching
        plan, or a packing plan's bins); each chunk's micro batches cover its rows
        contiguously from 0, so the end of its last one is its row count.

        Raises:
            ValueError: no plan is attached.
        """
        if self.micro_batch_indices is None:
            raise ValueError("no micro-batch plan is attached to this batch")
        return [ranges[-1][1] if ranges else 0 for ranges in self.micro_batch_indices]

    def get_microbatch_iterator_dynamic_shapes_len(self, batch_idx: int | None = None) -> int:
        """Number of micro batches ``make_microbatch_iterator_with_dynamic_shapes(batch_idx)``
        yields (all chunks for ``None``).

        Raises:
            ValueError: no plan is attached.
        """
        indices, _ = self._require_plan()
        return sum(len(indices[c]) for c in self._plan_chunk_ids(batch_idx))

    def _require_plan(self) -> tuple[list[list[tuple[int, int]]], list[list[int]]]:
        """The attached dynamic-batching plan ``(micro_batch_indices, micro_batch_lengths)``;
        raise unless one is attached."""
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise ValueError(
                "no dynamic-batching plan is attached to this batch; create it with "
                "shard_by_batch_size(..., dynamic_batching_args=...) (and get_batch)"
            )
        return self.micro_batch_indices, self.micro_batch_lengths

    def _plan_chunk_ids(self, batch_idx: int | None) -> list[int]:
        """Plan chunks selected by ``batch_idx`` (``None``: all)."""
        num_chunks = len(self._require_plan()[0])
        if batch_idx is None:
            return list(range(num_chunks))
        if not 0 <= batch_idx < num_chunks:
            raise IndexError(f"batch_idx {batch_idx} out of range for a plan of {num_chunks} chunks")
        return [batch_idx]

    def _plan_chunk_rows(self, chunk: int) -> tuple[int, int]:
        """Row range ``[start, end)`` of plan chunk ``chunk`` within this dict."""
        self._plan_chunk_ids(chunk)
        counts = self.plan_chunk_sizes()
        start = sum(counts[:chunk])
        return start, start + counts[chunk]


class SlicedDataDict(BatchedDataDict):
    """A ``BatchedDataDict`` that is a slice or shard of a larger batch.

    Behaves exactly like its parent; the distinct type documents (and lets type checkers
    see) that the rows are only part of the global batch.
    """


# ----------------------------------------------------------------- helpers


def _row_count(key: str, value: Any) -> int:
    """Rows held by ``value``: dim 0 of a tensor, length of a list."""
    if torch.is_tensor(value):
        if value.ndim == 0:
            raise TypeError(f"key {key!r} holds a 0-dim tensor; batched tensors need a batch dim")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(f"key {key!r} holds a {type(value).__name__}; BatchedDataDict values must be torch.Tensor or list")


def _normalize_indices(indices: Indices, size: int) -> list[int]:
    """Row indices as a list of ints, each checked to lie in ``[0, size)``."""
    if torch.is_tensor(indices):
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.ndim != 1:
            raise TypeError(
                f"indices must be a 1-D integer tensor, got dtype {indices.dtype} and shape {tuple(indices.shape)}"
            )
        rows = [int(i) for i in indices.tolist()]
    else:
        rows = [_as_index(i) for i in indices]
    bad = [i for i in rows if not 0 <= i < size]
    if bad:
        raise IndexError(f"row indices {bad[:5]} out of range for a batch of {size} rows")
    return rows


def _as_index(value: Any) -> int:
    """``value`` as an int index (Python/NumPy ints, 0-dim integer tensors)."""
    if isinstance(value, bool):
        # operator.index accepts bools; a boolean mask passed as a list is a bug here.
        raise TypeError(f"row indices must be ints, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"row indices must be ints, got {value!r}") from None


def _gather_rows(value: Value, rows: list[int]) -> Value:
    """Rows ``rows`` of a tensor (copied) or list, in that order."""
    if torch.is_tensor(value):
        index = torch.tensor(rows, dtype=torch.long, device=value.device)
        return value.index_select(0, index)
    return [value[i] for i in rows]


def _check_same_keys(batches: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``MissingKeyError`` naming a key present in some batches but not others."""
    all_keys = {key for batch in batches for key in batch}
    for position, batch in enumerate(batches):
        missing = [key for key in all_keys if key not in batch]
        if missing:
            raise MissingKeyError(
                f"key {sorted(missing)[0]!r} is missing from batch {position} (it has keys {sorted(batch)})"
            )


def _concat_values(key: str, values: list[Any], pad_value: int | float) -> Value:
    """Concatenate one key's values from several batches (see ``from_batches``)."""
    if all(isinstance(v, list) for v in values):
        return [item for value in values for item in value]
    if not all(torch.is_tensor(v) for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise ValueError(f"key {key!r} mixes value types {kinds}; expected all tensors or all lists")
    _check_tensor_compat(key, values)
    if values[0].ndim >= 2:
        width = max(v.shape[1] for v in values)
        values = [_pad_dim1(v, width, pad_value) for v in values]
    return torch.cat(values, dim=0)


def _check_tensor_compat(key: str, tensors: list[torch.Tensor]) -> None:
    """Tensors of one key must share rank, dims beyond dim 1, and dtype."""
    first = tensors[0]
    if first.ndim == 0:
        raise ValueError(f"key {key!r} holds a 0-dim tensor; batched tensors need a batch dim")
    for tensor in tensors[1:]:
        if tensor.ndim != first.ndim or tensor.shape[2:] != first.shape[2:]:
            raise ValueError(
                f"key {key!r}: cannot concatenate tensors of shapes {tuple(first.shape)} "
                f"and {tuple(tensor.shape)} (only dims 0 and 1 may differ)"
            )
        if tensor.dtype != first.dtype:
            raise ValueError(f"key {key!r}: cannot concatenate dtypes {first.dtype} and {tensor.dtype}")


def _pad_dim1(tensor: torch.Tensor, width: int, pad_value: int | float) -> torch.Tensor:
    """Right-pad dim 1 of ``tensor`` to ``width`` with ``pad_value``."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    # F.pad lists (left, right) pairs starting from the last dim; dims after 1 get none.
    pad = (0, 0) * (tensor.ndim - 2) + (0, missing)
    return F.pad(tensor, pad, mode="constant", value=pad_value)
