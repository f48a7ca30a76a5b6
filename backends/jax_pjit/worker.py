"""``JaxPolicyWorker``: the policy worker protocol on a flax model sharded over a JAX mesh.

One worker per host owns all of that host's devices (several hosts join one
``jax.distributed`` runtime, the coordinator being the worker group's MASTER_ADDR/PORT).
Data arrives as ``BatchedDataDict``s of torch tensors, is converted at this boundary to
host numpy, padded to a shape bucket (``steps.bucket_for``) and placed on the mesh.

Several processes (``jax.process_count() > 1``): each feeds its own rows of every micro
batch (``shard_host_batch``), gets its own rows of the outputs back, and the loss's valid
counts are summed over the processes; refit tensors and the HF export are gathered
(``sharding.host_copy``), offloaded state and the reference weights keep this process's
shards (``sharding.HostShards``).  Context parallelism, sequence packing and generation on
the policy workers are refused there (``_check_multi_process``).  One process runs exactly
the single-host code.

Context parallelism (``jax_cfg.context_parallel_size`` > 1: the mesh's ``cp`` axis splits
the sequence) and sequence packing (``policy.sequence_packing``: the driver's bins, or a
local plan, become packed rows; ``fsdp`` bins per micro batch) run through the
explicit-layout steps (``steps.make_layout_*``); without either, the original steps run
unchanged.  Generation decodes with the sequence replicated (``DECODE_RULES``).

Everything that is the same for all backends comes from ``core`` (losses, kernels, batch
checks); what is JAX-specific lives next to this file: model + HF mapping, mesh and
logical-axis rules, optax, jitted steps, generation.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from backends.jax_pjit import checkpoint as jax_ckpt
from backends.jax_pjit import steps
from backends.jax_pjit.generate import generate as jax_generate
from backends.jax_pjit.generate import make_decode_fns
from backends.jax_pjit.hf_mapping import expected_entries, flat_values, from_pretrained, hf_layout, save_hf_checkpoint
from backends.jax_pjit.logical_axes import DECODE_RULES, RULES
from backends.jax_pjit.model import activation_constraint, logical_axes_tree, make_apply_fn
from backends.jax_pjit.optim import build_optax, init_optimizer_state, set_learning_rate
from backends.jax_pjit.sharding import activation_constraint as make_constraint
from backends.jax_pjit.sharding import (
    check_divisible,
    check_process_rows,
    from_host_shards,
    host_copy,
    make_mesh,
    shard_host_batch,
    to_host_shards,
    tree_shardings,
)
from core.data import BatchedDataDict
from core.data.context_parallel import check_cp_width
from core.data.sequence_packing import check_packing_budget, plan_packed_micro_batches
from core.distributed.recoverable import before_collectives
from core.losses.metrics import MicroBatchMetrics, read_once
from core.policy.generation_args import resolve_generation_args
from core.policy.matmul_precision import resolve_matmul_precision
from core.policy.preflight import check_tensor_parallel_fits, check_tokenizer_fits
from core.policy.worker_base import REFERENCE_MISSING, PolicyWorkerBase, step_skip_reason

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def init_jax_distributed() -> None:
    """Join the multi-host runtime when the worker group has more than one host."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            num_processes=world,
            process_id=int(os.environ["RANK"]),
        )


class JaxPolicyWorker(PolicyWorkerBase):
    """One host of a JAX policy; constructed inside a Ray actor by ``core.policy.Policy``."""

    def __init__(
        self,
        config: Mapping[str, Any],
        tokenizer: Any = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **_: Any,
    ) -> None:
        init_jax_distributed()
        super().__init__(config, tokenizer)
        self.rank = jax.process_index()
        self.mesh = make_mesh(self.cfg)
        self._check_multi_process()
        self.compute_dtype = DTYPES[self.cfg["precision"]]
        # policy.matmul_precision, entered by _on_mesh around every device step (see there).
        self.matmul_precision = resolve_matmul_precision(self.cfg)
        # policy.jax_cfg.activation_checkpointing: remat every decoder layer of the grad steps.
        self.remat = bool((self.cfg.get("jax_cfg") or {}).get("activation_checkpointing", False))

        # A vocabulary tp does not divide is zero-padded inside the backend (embedding rows /
        # lm_head columns, masked logits); model_cfg.vocab_size and everything leaving the
        # worker (logprobs, refit, HF export) keep the real vocabulary.
        model, self.model_cfg, self.hf_config = from_pretrained(
            self.cfg["model_name"],
            dtype=self.compute_dtype,
            param_dtype=jnp.float32,
            tp=self.mesh.shape["tp"],
            make_vocab_size_divisible_by=int(self.cfg.get("make_vocab_size_divisible_by") or 1),
        )
        check_tokenizer_fits(tokenizer, self.hf_config, self.cfg["model_name"])
        check_tensor_parallel_fits(self.hf_config, self.mesh.shape["tp"], "policy.jax_cfg.tensor_parallel_size")
        self.model = model
        self.apply_fn, params = make_apply_fn(model)
        axes = logical_axes_tree(params)
        check_divisible(params, axes, self.mesh)
        self.shardings = tree_shardings(axes, self.mesh)
        self.params = jax.device_put(params, self.shardings)
        # The reference policy lives in host memory (numpy), swapped in by use_reference_model.
        self.reference = _stash(self.params) if init_reference_model else None

        self.tx = self.schedule = self.opt_state = None
        if init_optimizer and self.cfg.get("optimizer"):
            self.tx, self.schedule = build_optax(
                self.cfg["optimizer"], self.cfg.get("scheduler"), self.cfg.get("max_grad_norm")
            )
            with self.mesh:
                self.opt_state = init_optimizer_state(self.tx, self.params, self.shardings)
            opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
            self._apply_updates = steps.make_apply_updates(self.tx, self.shardings, opt_shardings)
        self.train_step = 0
        self._logprob_step = steps.make_logprob_step(self.apply_fn, self.temperature)
        self._grad_steps: dict[tuple, Any] = {}
        # Context parallelism / sequence packing: rows with explicit positions and segments.
        self.cp = int(self.mesh.shape["cp"])
        self.seq_multiple = int(self.cfg.get("make_sequence_length_divisible_by") or 1)
        self._check_widths()
        self._layout_logprob_step = steps.make_layout_logprob_step(self.apply_fn, self.temperature, self.cp)
        self._profile_dir: str | None = None
        self._decode_fns = make_decode_fns(model)
        # Refit: HF layout + cast on the devices, each shard where it is (no gather yet).
        self._hf_layout = jax.jit(hf_layout, static_argnums=(1, 2, 3, 4))
        self._host_copies: dict[str, tuple[Any, Any]] = {}  # offloaded state, as _stash returns it
        self._generate_calls = 0
        if weights_path:  # the Policy verified the manifests' checksums on the driver already
            self.load_checkpoint(weights_path, optimizer_path, checksums=not _.get("checkpoint_verified", False))

    # ------------------------------------------------------------------ identity
    def report_device_id(self) -> str:
        dev = jax.local_devices()[0]
        return f"{dev.platform}:{socket.gethostname()}:{os.getpid()}:{dev.id}"

    def get_gpu_info(self) -> dict[str, Any]:
        devs = jax.local_devices()
        info: dict[str, Any] = {
            "rank": self.rank,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device_type": devs[0].platform,
            "local_devices": len(devs),
            "mesh": dict(self.mesh.shape),
        }
        stats = devs[0].memory_stats() if hasattr(devs[0], "memory_stats") else None
        if stats:
            info.update(memory_in_use_bytes=stats.get("bytes_in_use"), peak_memory_bytes=stats.get("peak_bytes_in_use"))
        return info

    def reset_peak_memory_stats(self) -> None:
        pass  # XLA exposes no reset for its peak counter; get_gpu_info reports it as is

    @property
    def compile_counts(self) -> dict[str, int]:
        counts = {
            "logprobs": self._logprob_step._cache_size(),
            "logprobs_layout": self._layout_logprob_step._cache_size(),
        }
        counts.update({f"grad[{key[0]}#{i}]": fn._cache_size() for i, (key, fn) in enumerate(self._grad_steps.items())})
        return counts

    def get_compile_counts(self) -> dict[str, int]:
        """Programs compiled so far per jitted step (bounded by the number of length buckets)."""
        return self.compile_counts

    # ------------------------------------------------------------------ several processes
    def _check_multi_process(self) -> None:
        """Several JAX processes: refuse at start-up, naming the field, what is not supported
        across processes yet (it would run on each process's rows as if they were the whole
        batch); and a mesh on which a process does not own whole fsdp rows."""
        n = jax.process_count()
        if n == 1:
            return
        check_process_rows(self.mesh)
        unsupported = []
        if int(self.mesh.shape["cp"]) > 1:
            unsupported.append(
                f"policy.jax_cfg.context_parallel_size={int(self.mesh.shape['cp'])} (context parallelism)"
            )
        if self._packing is not None:
            unsupported.append("policy.sequence_packing.enabled=true (sequence packing)")
        if (self.cfg.get("generation") or {}).get("backend") == "hf":
            unsupported.append("policy.generation.backend='hf' (generation on the policy workers)")
        if unsupported:
            raise ValueError(
                f"multi-process JAX ({n} processes) does not support {'; '.join(unsupported)} "
                "yet: use one JAX process (one node) for it"
            )

    def _check_rows_split(self, rows: int, field: str) -> None:
        """Several processes: a micro batch of ``rows`` rows per process must split over the
        mesh's fsdp axis (one process cannot fall back to replicating its rows: the others'
        differ)."""
        n, fsdp = jax.process_count(), int(self.mesh.shape["fsdp"])
        if n > 1 and (rows * n) % fsdp:
            raise ValueError(
                f"{field}={rows} rows per process x {n} processes is not divisible by the mesh's "
                f"fsdp axis of size {fsdp}: multi-process JAX needs every micro batch split over fsdp"
            )

    def _host_rows_of(self, outs: list[jax.Array]) -> list[np.ndarray]:
        """Each step output's rows that belong to this process's input rows (one process: all),
        their transfers started together."""
        if jax.process_count() == 1:
            return jax.device_get(outs)  # numpy arrays
        from jax.experimental import multihost_utils

        local = multihost_utils.global_array_to_host_local_array(outs, self.mesh, [P("fsdp")] * len(outs))
        return jax.device_get(local)

    # ------------------------------------------------------------------ data
    def _device_batch(self, host: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
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

    @contextlib.contextmanager
    def _on_mesh(self, decode: bool = False) -> Iterator[None]:
        """The mesh, its activation-sharding hook and the matmul precision; ``decode``: the
        sequence replicated (``DECODE_RULES``: KV-cache decoding feeds one token per row,
        which cp cannot split).

        Every jitted step of this worker runs inside this block (it needs the mesh), so the
        precision reaches every program, a new step's too: ``jax.default_matmul_precision``
        is read when a step is traced and is part of jit's cache key, so each dot_general is
        lowered with ``policy.matmul_precision`` (``highest``: true fp32 on GPU, where JAX's
        default is TF32-class and fp32 training drifted from torch by 0.3 % in one step)."""
        if decode and jax.process_count() > 1:  # generate() would decode this host's rows as the global batch
            raise RuntimeError(
                f"generate: multi-process JAX ({jax.process_count()} processes) does not support "
                "generation on the policy workers yet; use policy.generation.backend='vllm'"
            )
        with (
            self.mesh,
            activation_constraint(make_constraint(self.mesh, DECODE_RULES if decode else RULES)),
            jax.default_matmul_precision(self.matmul_precision),
        ):
            yield

    # ------------------------------------------------------------------ layouts (CP, packing)
    @property
    def _packing(self) -> Mapping[str, Any] | None:
        """``policy.sequence_packing`` when enabled, else None."""
        sp = self.cfg.get("sequence_packing") or {}
        return sp if sp.get("enabled", False) else None

    @property
    def _plain(self) -> bool:
        """Plain right-padded rows through the original steps: no context parallelism, no packing."""
        return self.cp == 1 and self._packing is None

    def _check_widths(self) -> None:
        """Under context parallelism every width a step can see must split into 2 x cp chunks:
        refuse a ladder that cannot, naming ``policy.make_sequence_length_divisible_by``."""
        steps.check_cp_ladder(self.cfg["max_total_sequence_length"], self.cp, self.seq_multiple)
        if self._packing is not None:
            for key in ("train_mb_tokens", "logprob_mb_tokens"):
                steps.check_cp_ladder(self._packing[key], self.cp, self.seq_multiple, f"policy.sequence_packing.{key}")

    def _bucket(self, width: int) -> int:
        """The ladder width a plain batch of ``width`` columns is padded to."""
        bucket = steps.bucket_for(width, self.cfg["max_total_sequence_length"], self.seq_multiple)
        if self.cp > 1:
            check_cp_width(bucket, self.cp, 2 * self.cp, "policy.make_sequence_length_divisible_by")
        return bucket

    def _packed_bucket(self, tokens: int, budget_key: str) -> int:
        """The ladder width (up to the packing budget) of a packed row of ``tokens`` tokens."""
        bucket = steps.bucket_for(
            tokens, self._packing[budget_key], self.seq_multiple, f"policy.sequence_packing.{budget_key}"
        )
        if self.cp > 1:
            check_cp_width(bucket, self.cp, 2 * self.cp, "policy.make_sequence_length_divisible_by")
        return bucket

    def _packing_plan(
        self, data: BatchedDataDict, lengths: np.ndarray, chunk_rows: int, budget_key: str
    ) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        """Per chunk of ``chunk_rows`` rows: ``(row order within the chunk, bins)``, each bin a
        ``(start, end)`` range of the reordered chunk.  The driver's plan
        (``data.micro_batch_indices``: rows already reordered, the same number of bins on
        every host) is used when attached; otherwise the chunk is planned here."""
        n_chunks = len(lengths) // chunk_rows if chunk_rows else 0
        attached = getattr(data, "micro_batch_indices", None)
        if attached is not None:
            counts = [ranges[-1][1] if ranges else 0 for ranges in attached]
            if counts != [chunk_rows] * n_chunks:
                raise ValueError(
                    f"sequence packing plan covers chunks of {counts} rows, expected "
                    f"{n_chunks} chunk(s) of {chunk_rows}"
                )
            return [(np.arange(chunk_rows), [tuple(r) for r in ranges]) for ranges in attached]
        sp = self._packing
        check_packing_budget(lengths.tolist(), sp[budget_key], f"policy.sequence_packing.{budget_key}")
        plans = []
        for g in range(n_chunks):
            ((order, bins),) = plan_packed_micro_batches(
                [lengths[g * chunk_rows : (g + 1) * chunk_rows].tolist()],
                sp[budget_key],
                sp.get("algorithm", "modified_first_fit_decreasing"),
            )
            plans.append((np.asarray(order, np.int64), bins))
        return plans

    def _bin_groups(self, bins: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
        """``fsdp`` consecutive bins per micro batch: one packed row per fsdp shard."""
        fsdp = self.mesh.shape["fsdp"]
        for i in range(0, len(bins), fsdp):
            yield bins[i : i + fsdp]

    def _layout_logprobs(self, ids: np.ndarray, lengths: np.ndarray, data: BatchedDataDict, mbs: int) -> np.ndarray:
        """``get_logprobs`` layout [N, S] through the explicit-layout step (CP and/or packing)."""
        n, width = ids.shape
        out = np.zeros((n, width), np.float32)
        if self._packing is None:  # context parallelism on plain rows: mbs rows per micro batch
            bucket = self._bucket(width)
            starts = range(0, n, mbs)
            pending = []
            for start in starts:
                host = steps.pad_micro_batch(
                    {"input_ids": ids[start : start + mbs], "input_lengths": lengths[start : start + mbs]}, mbs, bucket
                )
                rows = steps.plain_rows(host["input_ids"], host["input_lengths"])
                pending.append(self._layout_logprob_step(self.params, self._device_batch(rows)))
            for start, next_lp in zip(starts, jax.device_get(pending), strict=True):  # read once all are queued
                count = min(mbs, n - start)
                out[start : start + count, 1:] = next_lp[:count, : width - 1]
            return out * (np.arange(width)[None, :] < lengths[:, None])
        fsdp = self.mesh.shape["fsdp"]
        unpack, pending = [], []
        for order, bins in self._packing_plan(data, lengths, n, "logprob_mb_tokens"):
            chunk_ids, chunk_lengths = ids[order], lengths[order]
            for group in self._bin_groups(bins):
                tokens = max(int(chunk_lengths[a:b].sum()) for a, b in group)
                rows, packs = steps.packed_micro_batch(
                    chunk_ids, chunk_lengths, group, fsdp, self._packed_bucket(tokens, "logprob_mb_tokens")
                )
                pending.append(self._layout_logprob_step(self.params, self._device_batch(rows)))
                unpack.append((order, group, packs))
        for (order, group, packs), next_lp in zip(
            unpack, jax.device_get(pending), strict=True
        ):  # read once all are queued
            for k, (a, b) in enumerate(group):
                out[order[a:b], 1:] = packs[k].unpack_next_logprobs(next_lp[k])
        return out

    # ------------------------------------------------------------------ logprobs
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        with before_collectives():
            self._check_batch(data, self.hf_config.vocab_size)  # XLA would wrap or NaN a bad id silently
            self._check_rows_split(
                micro_batch_size or self.cfg["logprob_batch_size"],
                "micro_batch_size" if micro_batch_size else "policy.logprob_batch_size",
            )
        self._reload("params")
        mbs = micro_batch_size or self.cfg["logprob_batch_size"]
        ids, lengths = data["input_ids"].numpy(), data["input_lengths"].numpy()
        width = ids.shape[1]
        if not self._plain:
            import torch

            with self._on_mesh():
                logprobs = self._layout_logprobs(ids, lengths, data, mbs)
            return BatchedDataDict(logprobs=torch.from_numpy(np.ascontiguousarray(logprobs)))
        bucket = steps.bucket_for(width, self.cfg["max_total_sequence_length"], self.seq_multiple)
        pending = []
        with self._on_mesh():
            for start in range(0, len(ids), mbs):
                host = steps.pad_micro_batch(
                    {"input_ids": ids[start : start + mbs], "input_lengths": lengths[start : start + mbs]}, mbs, bucket
                )
                dev = self._device_batch(host)
                pending.append(self._logprob_step(self.params, dev["input_ids"], dev["input_lengths"]))
        # Read only once every micro batch is queued: a read inside the loop would leave the
        # device idle while the host copies the result and prepares the next micro batch.
        outs = [
            lp[: min(mbs, len(ids) - start), :width]
            for start, lp in zip(range(0, len(ids), mbs), self._host_rows_of(pending), strict=True)
        ]
        import torch

        logprobs = np.concatenate(outs) if outs else np.zeros((0, width), np.float32)
        return BatchedDataDict(logprobs=torch.from_numpy(np.ascontiguousarray(logprobs)))

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        if self.reference is None:
            raise RuntimeError(REFERENCE_MISSING)
        self._reload("params")
        policy = self.params
        self.params = _unstash(*self.reference)
        try:
            yield
        finally:
            self.params = policy

    def get_reference_policy_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None):
        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    # ------------------------------------------------------------------ training
    def _grad_step(self, loss_fn: Any):
        # Keyed by the loss's configuration, not its identity: every Policy.train call ships
        # a fresh (unpickled) copy of the same loss, which must reuse the compiled program.
        key = _loss_key(loss_fn) + (() if self._plain else ("layout",))
        if key not in self._grad_steps:
            # Only the grad steps remat: a forward-only step has no backward to save memory for.
            apply_fn = functools.partial(self.apply_fn, remat=True) if self.remat else self.apply_fn
            if self._plain:
                self._grad_steps[key] = steps.make_grad_step(apply_fn, loss_fn, self.temperature, self.shardings)
            else:
                self._grad_steps[key] = steps.make_layout_grad_step(
                    apply_fn, loss_fn, self.temperature, self.cp, self.shardings
                )
        return self._grad_steps[key]

    def _micro_batches(
        self, gb: Mapping[str, np.ndarray], plan: Any, mbs: int, bucket: int
    ) -> Iterator[tuple[Any, ...]]:
        """The grad step's arguments before ``gseq, gtok`` for each micro batch of the
        (local) global batch ``gb``: ``(batch,)`` on plain rows; ``(rows, batch)`` for the
        layout step -- context parallelism on ``mbs`` plain rows, or packing: ``fsdp`` bins of
        the plan per micro batch as packed rows, with the loss batch = the bins' rows in the
        plain layout, padded to all of ``gb``'s rows (one program per packed width)."""
        rows_total = len(gb["input_ids"])
        if self._packing is None:
            for start in range(0, rows_total, mbs):
                mb = steps.pad_micro_batch({k: v[start : start + mbs] for k, v in gb.items()}, mbs, bucket)
                if self._plain:
                    yield (self._device_batch(mb),)
                else:
                    rows = steps.plain_rows(mb["input_ids"], mb["input_lengths"])
                    yield self._device_batch(rows), self._device_batch(mb)
            return
        order, bins = plan
        gb = steps.pad_micro_batch({k: v[order] for k, v in gb.items()}, rows_total, bucket)
        fsdp = self.mesh.shape["fsdp"]
        for group in self._bin_groups(bins):
            tokens = max(int(gb["input_lengths"][a:b].sum()) for a, b in group)
            rows, _ = steps.packed_micro_batch(
                gb["input_ids"],
                gb["input_lengths"],
                group,
                fsdp,
                self._packed_bucket(tokens, "train_mb_tokens"),
                unpack_rows=rows_total,
            )
            start, end = group[0][0], group[-1][1]
            mb = steps.pad_micro_batch({k: v[start:end] for k, v in gb.items()}, rows_total, bucket)
            yield self._device_batch(rows), self._device_batch(mb)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch in ``data`` (this host's rows of it).

        A step with no valid token, or a non-finite global loss or gradient norm, is skipped
        inside the jitted update (params and optimizer state kept); the learning-rate
        schedule advances only if at least one step of the call was applied, as on torch."""
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        n_hosts = jax.process_count()
        with before_collectives():
            local_gbs = self._check_train_call(
                data, loss_fn, gbs, mbs, n_hosts, self.hf_config.vocab_size, eval_mode, self.tx is not None
            )
            self._check_rows_split(
                mbs, "policy.train_micro_batch_size" if mbs == self.cfg["train_micro_batch_size"] else "mbs"
            )
            if not hasattr(loss_fn, "loss_from_logprobs"):
                raise ValueError(
                    f"loss {type(loss_fn).__name__} has no loss_from_logprobs: the jax_pjit backend computes every "
                    "loss from the token logprobs (it has no full-logits loss path); use a core.losses loss"
                )
        self.prepare_for_training()
        host = {k: v.numpy() for k, v in data.items() if hasattr(v, "numpy")}
        bucket = self._bucket(host["input_ids"].shape[1])
        plans = (
            self._packing_plan(data, host["input_lengths"], local_gbs, "train_mb_tokens")
            if self._packing is not None
            else None
        )
        grad_step = self._grad_step(loss_fn)
        losses, norms, step_metrics, all_mb, reasons = [], [], [], {}, []
        with self._on_mesh():
            if not eval_mode:
                self.opt_state = set_learning_rate(self.opt_state, self.schedule(self.train_step))
            for g in range(len(host["input_ids"]) // local_gbs):
                gb = {k: v[g * local_gbs : (g + 1) * local_gbs] for k, v in host.items()}
                gseq, gtok = steps.global_valid_counts(gb["sample_mask"], gb.get("token_mask"), gb["input_lengths"])
                acc = steps.zero_grads(self.params)
                collected = MicroBatchMetrics()
                for args in self._micro_batches(gb, plans[g] if plans else None, mbs, bucket):
                    acc, metrics = grad_step(self.params, acc, *args, gseq, gtok)
                    collected.add(metrics)  # stays on the device: read once, below
                keys = collected.keys
                table = collected.table(jnp.zeros((), jnp.float32))
                device_totals = table.sum(0)
                parts = [device_totals, table]
                if not eval_mode:
                    loss = device_totals[keys.index("loss")] if "loss" in keys else 0.0
                    valid = bool(gseq > 0 and gtok > 0)
                    self.params, self.opt_state, norm, skipped = self._apply_updates(
                        self.params, self.opt_state, acc, loss, valid
                    )
                    parts += [norm, skipped]
                # The step's one host read: totals, per-micro-batch values, norm and skip flag.
                values = read_once(*parts)
                totals = dict(zip(keys, values[0], strict=True))
                norm, reason = 0.0, None
                if not eval_mode:
                    norm = values[2][0]
                    if values[3][0]:
                        reason = (
                            step_skip_reason(float(gseq), float(gtok), totals.get("loss", 0.0), norm)
                            or "non_finite_grad_norm"
                        )
                reasons.append(reason)
                # Several processes: a micro batch spans them all, so every process holds the
                # same per-micro-batch values; process 0 alone reports them, so that the
                # Policy's concatenation over workers still sums to the step's value.
                if self.rank == 0:
                    for k, mb_values in collected.per_micro_batch(values[1]).items():
                        all_mb.setdefault(k, []).extend(mb_values)
                losses.append(totals.get("loss", 0.0))
                norms.append(norm)
                step_metrics.append(totals)
        if not eval_mode and any(r is None for r in reasons):
            self.train_step += 1
        lr = self.schedule(self.train_step) if self.schedule is not None else None
        return self._train_result(losses, norms, step_metrics, all_mb, lr, reasons)

    # ------------------------------------------------------------------ generation
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """KV-cache decoding on the sharded params, ``policy.generation_batch_size`` rows at a time;
        ``GenerationOutputSpec`` as torch tensors."""
        import torch

        with before_collectives():
            self._check_batch(data, self.hf_config.vocab_size)
            args = resolve_generation_args(
                self.cfg, self.tokenizer, self.hf_config.eos_token_id, data["input_ids"].shape[1]
            )
        self._reload("params")
        # Without data['sample_seeds'], a fresh sampling key per call: reproducible only for an
        # uninterrupted worker; with them every row samples from its own seed's key.
        self._generate_calls += 1
        seeds = data.get("sample_seeds")
        with self._on_mesh(decode=True):
            out = jax_generate(
                self._decode_fns,
                self.params,
                data["input_ids"].numpy(),
                data["input_lengths"].numpy(),
                args.gen_cfg,
                greedy=greedy,
                pad_token_id=args.pad_token_id,
                eos_token_ids=args.eos_token_ids,
                tokenizer=self.tokenizer,
                max_new_tokens=args.max_new_tokens,
                rng=self._generate_calls,
                stop_strings=data.get("stop_strings"),
                sample_seeds=None if seeds is None else np.asarray(seeds),
                batch_size=self.cfg.get("generation_batch_size"),
            )
        return BatchedDataDict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()})

    # ------------------------------------------------------------------ lifecycle
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Params and optimizer state back on the mesh (after an offload)."""
        self._reload("params")
        self._reload("opt_state")

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        """Params on the mesh; the optimizer state stays (or goes) to host memory."""
        self._reload("params")
        self._offload("opt_state")

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        pass  # training state stays resident until offloaded

    def offload_before_refit(self) -> None:
        """Free device memory for the refit: optimizer state to host memory."""
        self._offload("opt_state")

    def offload_after_refit(self) -> None:
        """The generation engine owns the devices now: params to host memory too."""
        self._offload("params")
        self._offload("opt_state")

    def _offload(self, name: str) -> None:
        """Move ``self.<name>`` (a sharded pytree) to host memory (``_stash``); the device
        buffers are freed when the last reference goes."""
        tree = getattr(self, name)
        if tree is None:
            return
        self._host_copies[name] = _stash(tree)
        setattr(self, name, None)

    def _reload(self, name: str) -> None:
        if name in self._host_copies:
            setattr(self, name, _unstash(*self._host_copies.pop(name)))

    def iter_full_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """``(hf_name, full tensor)`` in the HF layout and ``dtype`` (None: the params'), one
        tensor at a time, in ``expected_entries`` order.

        The HF layout (vocab cut, transpose) and the cast run on the devices, shard by shard
        (``hf_mapping.hf_layout``, one program per distinct shape: every layer shares it); then
        the tensor leaves them once (``_off_device``).  The old path copied the whole fp32
        model to the host and transposed and cast it there (9.7 s for 1.2 B params next to an
        H100, plus as much again for ``prepare_refit_info``, which read the same stream)."""
        self._reload("params")
        flat = flat_values(self.params)
        cast = None if dtype is None else jnp.dtype(dtype)
        for e in expected_entries(self.model_cfg):
            full = self._hf_layout(flat[e.jax_path], e.transform, e.vocab_dim, self.model_cfg.vocab_size, cast)
            yield e.hf_name, _off_device(full)

    def _refit_devices(self) -> list:
        """IPC buckets go to every local GPU (each colocated engine worker reads its own);
        on CPU, one host segment."""
        import torch

        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (HF shape, params' dtype) in stream order: metadata of the HF mapping
        (shapes of the abstract model), no gather and no device -> host copy."""
        dtype = jnp.dtype(self.model.param_dtype).name
        return {e.hf_name: (tuple(e.hf_shape), dtype) for e in expected_entries(self.model_cfg)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Orbax: sharded params (and optimizer state + step) for resume; atomic, with a
        manifest (``backends.jax_pjit.checkpoint``)."""
        self.prepare_for_training()  # offloaded state is saved from the mesh, sharded
        jax_ckpt.save_orbax(self.params, self.opt_state, self.train_step, weights_path, optimizer_path)
        self._save_tokenizer(tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None, checksums: bool = True) -> None:
        """Verified restore: manifests, kinds, and orbax's metadata against the live trees
        (keys and shapes) are checked before any array is read."""
        params, opt_state, step = jax_ckpt.load_orbax(
            self.params,
            self.opt_state,
            weights_path,
            optimizer_path,
            checksums=checksums,
            what=f"model {self.cfg['model_name']!r}",
        )
        self.params, self.opt_state = params, opt_state
        if step is not None:
            self.train_step = step

    def save_hf_checkpoint(self, path: str, save_tokenizer: bool = False) -> None:
        """HF safetensors that ``transformers`` (and the torch backends) load."""
        self._reload("params")
        params = host_copy(self.params)  # several processes: a collective, so every one gathers
        if self.rank == 0:
            from flax import nnx

            nnx.update(self.model, params)
            save_hf_checkpoint(self.model, self.hf_config, path)
            if save_tokenizer and self.tokenizer is not None:
                self.tokenizer.save_pretrained(path)

    # ------------------------------------------------------------------ profiling
    def start_gpu_profiling(self) -> None:
        self._profile_dir = str(
            Path(os.environ.get("DUALRL_PROFILE_DIR", "profiles")).resolve() / f"jax_rank{self.rank}"
        )
        jax.profiler.start_trace(self._profile_dir)

    def stop_gpu_profiling(self) -> str | None:
        if self._profile_dir is None:
            return None
        jax.profiler.stop_trace()
        path, self._profile_dir = self._profile_dir, None
        return path

    def shutdown(self) -> bool:
        """Several processes: leave the ``jax.distributed`` runtime together.  The group calls
        this on every worker at once; ``jax.distributed.shutdown`` waits for all of them, so
        the coordinator (process 0) does not vanish while another process is still attached
        to it -- which aborts that process (SIGABRT in its coordination-service agent)."""
        self.finish_refit_stream()  # the group ray.kill()s us next: exit handlers never run
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
        return True


def _stash(tree: Any) -> tuple[Any, Any]:
    """``tree`` in host memory, to go back onto the same shardings through ``_unstash``.

    One process: ``(numpy copy, shardings)``.  Several: ``(HostShards tree, None)``, only
    this process's shards -- no collective, and host memory for this host's share, where a
    full copy would gather every array to every host at each offload."""
    if jax.process_count() > 1:
        return to_host_shards(tree), None
    return jax.device_get(tree), jax.tree.map(lambda x: x.sharding, tree)


def _off_device(full: jax.Array) -> Any:
    """One (sharded) refit tensor as the stream carries it.  One process on GPU: gathered
    onto the first local GPU (device-to-device copies) and handed to torch by DLPack, no
    host trip (the CUDA IPC transport reads it there).  Else numpy: each shard copied to the
    host once, into the full array (several processes: all-gathered first, a collective).
    Not a replicated jit output: on CPU that all-gather cost 2-4x the host copy."""
    device = jax.local_devices()[0]
    if jax.process_count() == 1 and device.platform == "gpu":
        import torch

        return torch.from_dlpack(jax.device_put(full, device))
    return host_copy(full)


def _unstash(host: Any, shardings: Any) -> Any:
    return from_host_shards(host) if shardings is None else jax.device_put(host, shardings)


def _loss_key(loss_fn: Any) -> tuple:
    """(class name, its scalar settings): equal for two copies of one configured loss."""
    scalars = (bool, int, float, str, type(None), enum.Enum)
    settings = tuple(sorted((k, v) for k, v in vars(loss_fn).items() if isinstance(v, scalars)))
    return (type(loss_fn).__qualname__, settings)
