"""How the JAX worker's host rows become its jitted steps' device inputs, and come back.

Three layouts of a micro batch's rows:

* **plain** -- right-padded rows, padded to a shape bucket (``widths.bucket_for``), through the
  original steps;
* **context parallel** (``parallel.context_parallel_size`` > 1) -- the same rows with
  explicit positions and segments (``steps.plain_rows``), through the explicit-layout steps;
* **packed** (``policy.sequence_packing``) -- the driver's bins (or a local plan), ``fsdp``
  bins per micro batch, each bin one packed row (``steps.packed_micro_batch``).

Several JAX processes: each places its own rows of a micro batch on the mesh and reads
back its own rows of the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from backends.jax_pjit import steps, widths
from backends.jax_pjit.sharding import shard_host_batch
from backends.jax_pjit.spec import settings as jax_settings
from core.data import BatchedDataDict
from core.data.context_parallel import check_cp_width
from core.data.sequence_packing import check_packing_budget, plan_packed_micro_batches
from core.data.shared_prompts import plan_shared_prompt_micro_batches, prompt_groups
from core.policy.config import PolicyConfig, SequencePackingConfig

__all__ = ["DynamicChunk", "RowLayouts", "row_rung", "spread_bins"]

#: Rungs per doubling of the rows ladder of planned micro batches (:func:`row_rung`).
ROW_RUNGS_PER_DOUBLING = 4


def row_rung(rows: int, multiple: int) -> int:
    """The rows a planned micro batch of ``rows`` rows is padded to, a multiple of ``multiple``
    (the fsdp axis): the next rung of a ladder with :data:`ROW_RUNGS_PER_DOUBLING` rungs per
    doubling above 16 rows (..., 8, 16, 20, 24, 28, 32, 40, ...).  Each distinct shape is a
    compiled program, so rows are not kept exact (a plan's last micro batch has any count);
    a power of two would pad a micro batch of 65 rows to 128 (the token-budget plan's micro
    batches are seldom a power of two), the ladder pads it to 80: at most a quarter of
    padding rows for a few more programs.  Up to 16 rows, where padding costs little, powers
    of two."""
    if rows <= ROW_RUNGS_PER_DOUBLING**2:
        rung = 1 << max(rows - 1, 0).bit_length()
    else:
        rung = widths.octave_round_up(rows, ROW_RUNGS_PER_DOUBLING)
    return widths.round_up(max(rung, multiple), multiple)


def spread_bins(bins: list[tuple[int, int]], lengths: np.ndarray, shards: int) -> list[tuple[int, int]]:
    """``bins`` (row ranges of one micro batch, in order) split at row boundaries until there
    are ``shards`` of them or none has two rows: the fullest bin first, where its tokens
    halve.  A micro batch gives every fsdp shard one packed row of the width of its fullest
    bin, so a missing bin is a row of padding as wide as the others, and a split bin a
    narrower width.  Deterministic in ``bins`` and ``lengths`` (every host splits alike);
    the ranges stay contiguous and ordered, each sequence whole in one of them."""
    out = list(bins)
    while len(out) < shards:
        splittable = [(int(lengths[a:b].sum()), i) for i, (a, b) in enumerate(out) if b - a >= 2]
        if not splittable:
            break
        i = max(splittable)[1]
        a, b = out[i]
        before = np.cumsum(lengths[a:b])[:-1]  # tokens left of each cut a+1 .. b-1
        cut = a + 1 + int(np.argmin(np.abs(2 * before - before[-1] - int(lengths[b - 1]))))
        out[i : i + 1] = [(a, cut), (cut, b)]
    return out


@dataclass(frozen=True)
class DynamicChunk:
    """One global batch's share of the driver's dynamic-batching plan: ``(start, end)`` row
    ranges and each micro batch's padded length."""

    ranges: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]


def _check_plan_chunks(what: str, data: BatchedDataDict, chunk_rows: int, n_chunks: int) -> None:
    """A driver's plan attached to ``data`` must cover ``n_chunks`` chunks of ``chunk_rows``
    rows each -- one per global batch of this call."""
    counts = data.plan_chunk_sizes()
    if counts != [chunk_rows] * n_chunks:
        raise ValueError(f"{what} plan covers chunks of {counts} rows, expected {n_chunks} chunk(s) of {chunk_rows}")


class RowLayouts:
    """The row layouts of one worker: its mesh and the ``policy`` config's widths and packing."""

    def __init__(self, cfg: PolicyConfig, mesh: Mesh) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.cp = int(mesh.shape["cp"])
        self.seq_multiple = cfg.make_sequence_length_divisible_by
        #: ``policy.jax_cfg.padded_widths_per_doubling``: the rungs of the widths ladder.
        self.per_doubling = jax_settings(cfg).padded_widths_per_doubling
        #: ``policy.sequence_packing`` when enabled, else None.
        self.packing: SequencePackingConfig | None = cfg.sequence_packing if cfg.sequence_packing.enabled else None
        #: ``policy.sequence_packing.shared_prompts``: a bin's rows of one prompt hold it once.
        self.shared_prompts = self.packing is not None and self.packing.shared_prompts

    @property
    def band_block(self) -> int | None:
        """Packed rows attend over a band of keys (``steps.packed_micro_batch``), except under
        context parallelism, whose columns are permuted before the model."""
        return steps.BAND_BLOCK if self.cp == 1 else None

    @property
    def plain(self) -> bool:
        """Plain right-padded rows through the original steps: no context parallelism, no packing."""
        return self.cp == 1 and self.packing is None

    # ------------------------------------------------------------------ widths
    def check_widths(self) -> None:
        """Under context parallelism every width a step can see must split into 2 x cp chunks:
        refuse a ladder that cannot, naming ``policy.make_sequence_length_divisible_by`` (the
        driver's config check refuses it first; a worker built on its own checks here)."""
        widths.check_cp_ladders(self.cfg, self.cp, self.per_doubling)

    def bucket(self, width: int) -> int:
        """The ladder width a plain batch of ``width`` columns is padded to."""
        bucket = widths.bucket_for(
            width, self.cfg.max_total_sequence_length, self.seq_multiple, per_doubling=self.per_doubling
        )
        if self.cp > 1:
            check_cp_width(bucket, self.cp, 2 * self.cp, "policy.make_sequence_length_divisible_by")
        return bucket

    def packed_bucket(self, tokens: int, budget_key: str) -> int:
        """The ladder width (up to the packing budget) of a packed row of ``tokens`` tokens."""
        bucket = widths.bucket_for(
            tokens,
            getattr(self.packing, budget_key),
            self.seq_multiple,
            f"policy.sequence_packing.{budget_key}",
            self.per_doubling,
        )
        if self.cp > 1:
            check_cp_width(bucket, self.cp, 2 * self.cp, "policy.make_sequence_length_divisible_by")
        return bucket

    # ------------------------------------------------------------------ host <-> device
    def check_rows_split(self, rows: int, field: str) -> None:
        """A micro batch holds ``rows`` rows on each device of the mesh's fsdp (data-parallel)
        axis; several processes each feed an equal share of them."""
        n, fsdp = jax.process_count(), int(self.mesh.shape["fsdp"])
        if (rows * fsdp) % n:
            raise ValueError(
                f"{field}={rows} rows per data-parallel device x fsdp {fsdp} is not divisible by the {n} "
                "processes: each process feeds an equal share of every micro batch"
            )

    def device_batch(self, host: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host arrays -> device arrays, rows split over ``fsdp`` when they divide it.
        Several processes: ``host`` is this process's rows of the global micro batch."""
        if jax.process_count() > 1:
            return {key: shard_host_batch(value, self.mesh, ("batch",)) for key, value in host.items()}
        fsdp = self.mesh.shape["fsdp"]
        out = {}
        for key, value in host.items():
            spec = P("fsdp") if value.shape[0] % fsdp == 0 else P()
            out[key] = jax.device_put(jnp.asarray(value), NamedSharding(self.mesh, spec))
        return out

    def host_rows_of(self, outs: list[jax.Array]) -> list[np.ndarray]:
        """Each step output's rows that belong to this process's input rows (one process: all),
        their transfers started together."""
        if jax.process_count() == 1:
            return jax.device_get(outs)  # numpy arrays
        from jax.experimental import multihost_utils

        local = multihost_utils.global_array_to_host_local_array(outs, self.mesh, [P("fsdp")] * len(outs))
        return jax.device_get(local)

    # ------------------------------------------------------------------ sequence packing
    def packing_plan(
        self, data: BatchedDataDict, lengths: np.ndarray, chunk_rows: int, budget_key: str
    ) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        """Per chunk of ``chunk_rows`` rows: ``(row order within the chunk, bins)``, each bin a
        ``(start, end)`` range of the reordered chunk.  The driver's plan
        (``data.micro_batch_indices``: rows already reordered, the same number of bins on
        every host) is used when attached; otherwise the chunk is planned here."""
        n_chunks = len(lengths) // chunk_rows if chunk_rows else 0
        attached = getattr(data, "micro_batch_indices", None)
        if attached is not None:
            _check_plan_chunks("sequence packing", data, chunk_rows, n_chunks)
            return [(np.arange(chunk_rows), [tuple(r) for r in ranges]) for ranges in attached]
        sp = self.packing
        if sp is None:
            raise ValueError("packing_plan: policy.sequence_packing is not enabled")
        budget = getattr(sp, budget_key)
        check_packing_budget(lengths.tolist(), budget, f"policy.sequence_packing.{budget_key}")
        plans = []
        mask = self._token_mask(data)  # once per call, not per chunk
        for g in range(n_chunks):
            rows = slice(g * chunk_rows, (g + 1) * chunk_rows)
            chunk = lengths[rows].tolist()
            if mask is not None:
                groups = prompt_groups(data["input_ids"][rows], chunk, mask[rows])
                ((order, bins),) = plan_shared_prompt_micro_batches([(chunk, groups)], budget, sp.algorithm)
            else:
                ((order, bins),) = plan_packed_micro_batches([chunk], budget, sp.algorithm)
            plans.append((np.asarray(order, np.int64), bins))
        return plans

    def _token_mask(self, data: Mapping[str, Any]) -> np.ndarray | None:
        """``data``'s token mask (host) when shared-prompt packing can use it, else None."""
        if not self.shared_prompts or "token_mask" not in data:
            return None
        mask = data["token_mask"]
        return mask.numpy() if hasattr(mask, "numpy") else np.asarray(mask)

    def _bin_tokens(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None, group: list) -> int:
        """Tokens of the fullest packed row of ``group``'s bins."""
        if mask is None:
            return max(int(lengths[a:b].sum()) for a, b in group)
        return max(steps.bin_layout(ids, lengths, mask, a, b).tokens for a, b in group)

    def _bin_groups(self, bins: list[tuple[int, int]], lengths: np.ndarray) -> Iterator[list[tuple[int, int]]]:
        """``fsdp`` consecutive bins per micro batch: one packed row per fsdp shard.  A micro batch
        with fewer bins than shards (a batch smaller than ``fsdp`` budgets, or the plan's last
        micro batch) has its bins split until every shard has a row (:func:`spread_bins`)."""
        fsdp = self.mesh.shape["fsdp"]
        for i in range(0, len(bins), fsdp):
            yield spread_bins(bins[i : i + fsdp], lengths, fsdp)

    # ------------------------------------------------------------------ training
    def _attached_plan(self, data: BatchedDataDict) -> tuple[list, list] | None:
        """The driver's dynamic-batching plan ``(micro_batch_indices, micro_batch_lengths)``
        attached to ``data``; None when dynamic batching is off or no plan is attached."""
        if not self.cfg.dynamic_batching.enabled or self.packing is not None:
            return None
        indices, lengths = getattr(data, "micro_batch_indices", None), getattr(data, "micro_batch_lengths", None)
        return None if indices is None or lengths is None else (indices, lengths)

    def dynamic_plan(self, data: BatchedDataDict, chunk_rows: int) -> list[DynamicChunk] | None:
        """``policy.dynamic_batching``: the driver's token-budget plan of each chunk of
        ``chunk_rows`` rows (rows already sorted by length; the plan is the same on every host)."""
        attached = self._attached_plan(data)
        if attached is None:
            return None
        _check_plan_chunks("dynamic batching", data, chunk_rows, len(attached[0]))
        return [DynamicChunk(tuple(map(tuple, r)), tuple(w)) for r, w in zip(*attached, strict=True)]

    def dynamic_segments(self, data: BatchedDataDict) -> list[tuple[int, int, int]] | None:
        """Every planned micro batch of ``data`` as ``(start, end, padded length)`` over all its
        rows (an inference call's plan)."""
        return None if self._attached_plan(data) is None else data.planned_micro_batches()

    def dynamic_shape(self, rows: int, length: int) -> tuple[int, int]:
        """``(rows, width)`` a planned micro batch is padded to: the width its plan gives (a
        multiple of ``sequence_length_round``; context parallelism: the ladder's rung), the rows
        up to :func:`row_rung` of the fsdp axis -- few distinct shapes, so few compiled
        programs, and every host pads the same plan to the same shape."""
        width = self.bucket(length) if self.cp > 1 else widths.round_up(length, self.seq_multiple)
        return row_rung(rows, int(self.mesh.shape["fsdp"])), width

    def train_micro_batches(
        self, gb: Mapping[str, np.ndarray], plan: Any, mbs: int, bucket: int
    ) -> Iterator[tuple[Any, ...]]:
        """The grad step's arguments before ``gseq, gtok`` for each micro batch of the
        (local) global batch ``gb``: ``(batch,)`` on plain rows; ``(rows, batch)`` for the
        layout step -- context parallelism on ``mbs`` plain rows, or packing: ``fsdp`` bins of
        the plan per micro batch as packed rows, with the loss batch = the bins' rows in the
        plain layout, padded to all of ``gb``'s rows (one program per packed width)."""
        rows_total = len(gb["input_ids"])
        if isinstance(plan, DynamicChunk):
            for (start, end), length in zip(plan.ranges, plan.lengths, strict=True):
                padded_rows, width = self.dynamic_shape(end - start, length)
                # the plan's width covers every row's real tokens: only padding is cut
                cut = {k: (v[start:end, :width] if v.ndim >= 2 else v[start:end]) for k, v in gb.items()}
                mb = steps.pad_micro_batch(cut, padded_rows, width)
                if self.plain:
                    yield (self.device_batch(mb),)
                else:
                    yield (
                        self.device_batch(steps.plain_rows(mb["input_ids"], mb["input_lengths"])),
                        self.device_batch(mb),
                    )
            return
        if self.packing is None:
            for start in range(0, rows_total, mbs):
                mb = steps.pad_micro_batch({k: v[start : start + mbs] for k, v in gb.items()}, mbs, bucket)
                if self.plain:
                    yield (self.device_batch(mb),)
                else:
                    rows = steps.plain_rows(mb["input_ids"], mb["input_lengths"])
                    yield self.device_batch(rows), self.device_batch(mb)
            return
        order, bins = plan
        gb = steps.pad_micro_batch({k: v[order] for k, v in gb.items()}, rows_total, bucket)
        fsdp = self.mesh.shape["fsdp"]
        mask = self._token_mask(gb)
        for group in self._bin_groups(bins, gb["input_lengths"]):
            tokens = self._bin_tokens(gb["input_ids"], gb["input_lengths"], mask, group)
            rows, _ = steps.packed_micro_batch(
                gb["input_ids"],
                gb["input_lengths"],
                group,
                fsdp,
                self.packed_bucket(tokens, "train_mb_tokens"),
                unpack_rows=rows_total,
                token_mask=mask,
                band_block=self.band_block,
            )
            start, end = group[0][0], group[-1][1]
            mb = steps.pad_micro_batch({k: v[start:end] for k, v in gb.items()}, rows_total, bucket)
            yield self.device_batch(rows), self.device_batch(mb)

    # ------------------------------------------------------------------ logprobs
    def layout_logprobs(
        self,
        logprob_step: Callable,
        params: Any,
        ids: np.ndarray,
        lengths: np.ndarray,
        data: BatchedDataDict,
        mbs: int,
    ) -> np.ndarray:
        """``get_logprobs`` layout [N, S] through the explicit-layout step (CP and/or packing)."""
        n, width = ids.shape
        out = np.zeros((n, width), np.float32)
        if self.packing is None:  # context parallelism on plain rows: mbs rows per micro batch
            bucket = self.bucket(width)
            starts = range(0, n, mbs)
            pending = []
            for start in starts:
                host = steps.pad_micro_batch(
                    {"input_ids": ids[start : start + mbs], "input_lengths": lengths[start : start + mbs]}, mbs, bucket
                )
                rows = steps.plain_rows(host["input_ids"], host["input_lengths"])
                pending.append(logprob_step(params, self.device_batch(rows)))
            for start, next_lp in zip(starts, jax.device_get(pending), strict=True):  # read once all are queued
                count = min(mbs, n - start)
                out[start : start + count, 1:] = next_lp[:count, : width - 1]
            return out * (np.arange(width)[None, :] < lengths[:, None])
        fsdp = self.mesh.shape["fsdp"]
        unpack, pending = [], []
        data_mask = self._token_mask(data)
        for order, bins in self.packing_plan(data, lengths, n, "logprob_mb_tokens"):
            chunk_ids, chunk_lengths = ids[order], lengths[order]
            mask = None if data_mask is None else data_mask[order]
            for group in self._bin_groups(bins, chunk_lengths):
                tokens = self._bin_tokens(chunk_ids, chunk_lengths, mask, group)
                rows, packs = steps.packed_micro_batch(
                    chunk_ids,
                    chunk_lengths,
                    group,
                    fsdp,
                    self.packed_bucket(tokens, "logprob_mb_tokens"),
                    token_mask=mask,
                    band_block=self.band_block,
                )
                pending.append(logprob_step(params, self.device_batch(rows)))
                unpack.append((order, group, packs))
        for (order, group, packs), next_lp in zip(
            unpack, jax.device_get(pending), strict=True
        ):  # read once all are queued
            for k, (a, b) in enumerate(group):
                out[order[a:b], 1:] = packs[k].unpack_next_logprobs(next_lp[k])
        return out
