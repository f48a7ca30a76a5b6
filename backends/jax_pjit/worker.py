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
unchanged.  ``row_layouts.RowLayouts`` turns host rows into each layout's micro batches.
Generation decodes with the sequence replicated (``DECODE_RULES``).

``train`` reads side by side with the torch workers' (``core.policy.worker_base``):
``train`` -> ``_train_global_batch`` -> ``_run_micro_batches``, ``_optimizer_step``,
``_read_step``.

Everything that is the same for all backends comes from ``core`` (losses, kernels, batch
checks, the worker base); what is JAX-specific lives next to this file: models + HF mapping,
mesh and logical-axis rules, row layouts, optax, jitted steps, generation.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax_pjit import checkpoint as jax_ckpt
from backends.jax_pjit import steps
from backends.jax_pjit.exact_generate import make_exact_decode_fns
from backends.jax_pjit.exact_steps import make_exact_grad_step, make_exact_logprob_step
from backends.jax_pjit.generate import generate as jax_generate
from backends.jax_pjit.generate import make_decode_fns
from backends.jax_pjit.hf_mapping import (
    entry_value,
    expected_entries,
    flat_values,
    from_pretrained,
    hf_layout,
    save_hf_checkpoint,
)
from backends.jax_pjit.logical_axes import DECODE_RULES, RULES
from backends.jax_pjit.lora import LoRAParam, apply_lora, merged_flat, module_at, split_trainable
from backends.jax_pjit.models import logical_axes_tree, make_apply_fn
from backends.jax_pjit.models.layers import activation_constraint
from backends.jax_pjit.optim import build_optax, init_optimizer_state, set_learning_rate
from backends.jax_pjit.row_layouts import RowLayouts
from backends.jax_pjit.sharding import activation_constraint as make_constraint
from backends.jax_pjit.sharding import (
    check_divisible,
    check_process_rows,
    host_copy,
    make_mesh,
    off_device,
    stash,
    tree_shardings,
    unstash,
)
from core.data import BatchedDataDict
from core.distributed.recoverable import before_collectives
from core.interfaces import TrainResult
from core.losses.metrics import MicroBatchMetrics
from core.losses.router_aux import router_aux_for
from core.models.lora import adapter_names, lora_scale, peft_name, write_peft_adapter
from core.policy.generation_args import batch_generation_args
from core.policy.matmul_precision import resolve_matmul_precision
from core.policy.preflight import check_tensor_parallel_fits, check_tokenizer_fits
from core.policy.worker_base import (
    LORA_ADAPTER_DIR,
    OPTIMIZER_MISSING,
    REFERENCE_MISSING,
    PolicyWorkerBase,
    StepResult,
    reports_worker_seconds,
    step_skip_reason,
)

if TYPE_CHECKING:
    import optax

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
        # How host rows become device micro batches: plain, context-parallel or packed rows.
        self.rows = RowLayouts(self.cfg, self.mesh)
        self._check_multi_process()
        self.compute_dtype = DTYPES[self.cfg.precision]
        # policy.matmul_precision, entered by _on_mesh around every device step (see there).
        self.matmul_precision = resolve_matmul_precision(self.cfg)
        # policy.jax_cfg.activation_checkpointing: remat every decoder layer of the grad steps.
        self.remat = self.cfg.jax_cfg.activation_checkpointing

        # A vocabulary tp does not divide is zero-padded inside the backend (embedding rows /
        # lm_head columns, masked logits); model_cfg.vocab_size and everything leaving the
        # worker (logprobs, refit, HF export) keep the real vocabulary.
        model, self.model_cfg, self.hf_config = from_pretrained(
            self.cfg.model_name,
            dtype=self.compute_dtype,
            param_dtype=jnp.float32,
            tp=self.mesh.shape["tp"],
            make_vocab_size_divisible_by=int(self.cfg.make_vocab_size_divisible_by or 1),
            moe_dispatch=self.cfg.jax_cfg.moe_dispatch,
            expert_parallel=self.cfg.jax_cfg.expert_parallel_size,
        )
        check_tokenizer_fits(tokenizer, self.hf_config, self.cfg.model_name)
        check_tensor_parallel_fits(self.hf_config, self.mesh.shape["tp"], "policy.jax_cfg.tensor_parallel_size")
        # policy.lora: adapters on the targeted Dense layers; only they train (``self.trainable``).
        # A resumed run (weights_path) takes them from its checkpoint, not policy.lora.adapter_path.
        lora = self.cfg.lora
        self.lora = apply_lora(model, self.model_cfg, lora, resume=bool(weights_path)) if lora.enabled else []
        self.lora_scale = lora_scale(self.cfg.lora.alpha, self.cfg.lora.rank, self.cfg.lora.use_rslora)
        self.trainable = LoRAParam if self.lora else None
        # A MoE model's training steps add the router's load-balancing loss (policy.moe).
        self.router_aux = router_aux_for(self.cfg.moe.router_aux_loss_coef, self.hf_config)
        self.model = model
        # policy.numerics exact: the exact forward (models.exact) in the steps and the sampler.
        self._exact = self.cfg.numerics == "exact"
        self.apply_fn, params = make_apply_fn(model)
        axes = logical_axes_tree(params)
        check_divisible(params, axes, self.mesh)
        self.shardings = tree_shardings(axes, self.mesh)
        self.params = jax.device_put(params, self.shardings)
        # The reference policy lives in host memory (numpy), swapped in by use_reference_model.
        self.reference = stash(self.params) if init_reference_model else None

        self.tx: optax.GradientTransformationExtraArgs | None = None
        self.schedule: Callable[[int], float] | None = None
        self.opt_state: Any = None
        if init_optimizer and self.cfg.optimizer:
            self.tx, self.schedule = build_optax(self.cfg.optimizer, self.cfg.scheduler, self.cfg.max_grad_norm)
            with self.mesh:
                self.opt_state = init_optimizer_state(
                    self.tx, self._trainable(self.params), self._trainable(self.shardings)
                )
            opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
            self._apply_updates = steps.make_apply_updates(self.tx, self.shardings, opt_shardings, self.trainable)
        self.train_step = 0
        # A MoE policy recording its routing (policy.moe) gets each token's experts back too.
        self.route_top_k = self.router_aux.top_k if self.router_aux and self.cfg.moe.records_routing else None
        self._logprob_step = (
            make_exact_logprob_step(model, self.temperature, self.mesh)
            if self._exact
            else steps.make_logprob_step(self.apply_fn, self.temperature, self.route_top_k)
        )
        self._grad_steps: dict[tuple, Any] = {}
        # Context parallelism / sequence packing: rows with explicit positions and segments.
        self.rows.check_widths()
        self._layout_logprob_step = steps.make_layout_logprob_step(self.apply_fn, self.temperature, self.rows.cp)
        self._profile_dir: str | None = None
        self._decode_fns = make_exact_decode_fns(model, self.mesh) if self._exact else make_decode_fns(model)
        # Refit: HF layout + cast on the devices, each shard where it is (no gather yet).
        self._hf_layout = jax.jit(hf_layout, static_argnums=(1, 2, 3, 4))
        self._host_copies: dict[str, tuple[Any, Any]] = {}  # offloaded state, as sharding.stash returns it
        self._generate_calls = 0
        if weights_path:  # the Policy verified the manifests' checksums on the driver already
            self.load_checkpoint(weights_path, optimizer_path, checksums=not _.get("checkpoint_verified", False))

    def _trainable(self, tree: Any) -> Any:
        """The part of a params-shaped tree that trains: all of it, or with LoRA the adapters."""
        return tree if self.trainable is None else split_trainable(tree, self.trainable)[0]

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
        # _cache_size: jax's private count of a jitted function's programs (not in its types).
        counts = {
            "logprobs": self._logprob_step._cache_size(),  # type: ignore[attr-defined]
            "logprobs_layout": self._layout_logprob_step._cache_size(),  # type: ignore[attr-defined]
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
        if self.rows.packing is not None:
            unsupported.append("policy.sequence_packing.enabled=true (sequence packing)")
        if self.cfg.generation is not None and self.cfg.generation.backend == "hf":
            unsupported.append("policy.generation.backend='hf' (generation on the policy workers)")
        if unsupported:
            raise ValueError(
                f"multi-process JAX ({n} processes) does not support {'; '.join(unsupported)} "
                "yet: use one JAX process (one node) for it"
            )

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

    # ------------------------------------------------------------------ logprobs
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"logprobs": [B, S] float32}`` in the ``get_logprobs`` layout, as a torch tensor."""
        import torch

        with before_collectives():
            self._check_batch(data, self.hf_config.vocab_size)  # XLA would wrap or NaN a bad id silently
            self.rows.check_rows_split(
                micro_batch_size or self.cfg.logprob_batch_size,
                "micro_batch_size" if micro_batch_size else "policy.logprob_batch_size",
            )
        self._reload("params")
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        ids, lengths = data["input_ids"].numpy(), data["input_lengths"].numpy()
        routed = None
        if self.rows.plain:
            logprobs, routed = self._plain_logprobs(ids, lengths, mbs)
        else:
            with self._on_mesh():
                logprobs = self.rows.layout_logprobs(self._layout_logprob_step, self.params, ids, lengths, data, mbs)
        out: BatchedDataDict[Any] = BatchedDataDict(logprobs=torch.from_numpy(np.ascontiguousarray(logprobs)))
        if routed is not None:  # policy.moe.records_routing: each token's experts, for the training step
            out["routed_experts"] = torch.from_numpy(np.ascontiguousarray(routed))
        return out

    def _plain_logprobs(self, ids: np.ndarray, lengths: np.ndarray, mbs: int) -> tuple[np.ndarray, np.ndarray | None]:
        """[N, S] logprobs of plain right-padded rows, ``mbs`` rows per micro batch, and (a MoE
        policy recording its routing) the rows' ``routed_experts`` [N, S, sparse layers, top_k]."""
        width = ids.shape[1]
        bucket = steps.bucket_for(width, self.cfg.max_total_sequence_length, self.rows.seq_multiple)
        pending = []
        with self._on_mesh():
            for start in range(0, len(ids), mbs):
                host = steps.pad_micro_batch(
                    {"input_ids": ids[start : start + mbs], "input_lengths": lengths[start : start + mbs]}, mbs, bucket
                )
                dev = self.rows.device_batch(host)
                pending.append(self._logprob_step(self.params, dev["input_ids"], dev["input_lengths"]))
        # Read only once every micro batch is queued: a read inside the loop would leave the
        # device idle while the host copies the result and prepares the next micro batch.
        per_step = 1 if self.route_top_k is None else 2  # (logprobs[, routed_experts]) per micro batch
        read = self.rows.host_rows_of([x for out in pending for x in (out if per_step > 1 else (out,))])
        counts = [min(mbs, len(ids) - start) for start in range(0, len(ids), mbs)]

        def joined(j: int, empty: np.ndarray) -> np.ndarray:
            parts = [read[i * per_step + j][:n, :width] for i, n in enumerate(counts)]
            return np.concatenate(parts) if parts else empty

        logprobs = joined(0, np.zeros((0, width), np.float32))
        return logprobs, (joined(1, np.zeros((0, width, 0, 0), np.int16)) if per_step > 1 else None)

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        if self.reference is None:
            raise RuntimeError(REFERENCE_MISSING)
        self._reload("params")
        policy = self.params
        self.params = unstash(*self.reference)
        try:
            yield
        finally:
            self.params = policy

    # ------------------------------------------------------------------ training
    @reports_worker_seconds
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per global batch in ``data`` (this host's rows of it).

        A step with no valid token, or a non-finite global loss or gradient norm, is skipped
        inside the jitted update (params and optimizer state kept); the learning-rate
        schedule advances only if at least one step of the call was applied, as on torch."""
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        n_hosts = jax.process_count()
        with before_collectives():
            local_gbs = self._check_train_call(
                data, loss_fn, gbs, mbs, n_hosts, self.hf_config.vocab_size, eval_mode, self.tx is not None
            )
            self.rows.check_rows_split(
                mbs, "policy.train_micro_batch_size" if mbs == self.cfg.train_micro_batch_size else "mbs"
            )
            if not hasattr(loss_fn, "loss_from_logprobs"):
                raise ValueError(
                    f"loss {type(loss_fn).__name__} has no loss_from_logprobs: the jax_pjit backend computes every "
                    "loss from the token logprobs (it has no full-logits loss path); use a core.losses loss"
                )
        self.prepare_for_training()
        host = {k: v.numpy() for k, v in data.items() if hasattr(v, "numpy")}
        bucket = self.rows.bucket(host["input_ids"].shape[1])
        plans = (
            self.rows.packing_plan(data, host["input_lengths"], local_gbs, "train_mb_tokens")
            if self.rows.packing is not None
            else None
        )
        grad_step = self._grad_step(loss_fn)
        results = []
        with self._on_mesh():
            if not eval_mode:
                if self.schedule is None:  # _check_train_call refused training without an optimizer
                    raise RuntimeError(OPTIMIZER_MISSING)
                self.opt_state = set_learning_rate(self.opt_state, self.schedule(self.train_step))
            for g in range(len(host["input_ids"]) // local_gbs):
                gb = {k: v[g * local_gbs : (g + 1) * local_gbs] for k, v in host.items()}
                plan = plans[g] if plans else None
                results.append(self._train_global_batch(gb, plan, grad_step, mbs, bucket, eval_mode))
        if not eval_mode and any(r.skip_reason is None for r in results):
            self.train_step += 1
        lr = self.schedule(self.train_step) if self.schedule is not None else None
        return self._train_steps_result(results, lr)

    def _train_global_batch(
        self, gb: Mapping[str, np.ndarray], plan: Any, grad_step: Any, mbs: int, bucket: int, eval_mode: bool
    ) -> StepResult:
        """Forward/backward every micro batch of one global batch, then one optimizer step
        unless its counts, loss or gradient norm say to skip it.  The jitted update makes that
        decision on the device, so -- unlike on torch, which decides on the host -- the update
        is queued before the step's one host read (totals, per-micro-batch values, norm and
        skip flag), and the read only reports what it did."""
        gseq, gtok = steps.global_valid_counts(gb["sample_mask"], gb.get("token_mask"), gb["input_lengths"])
        acc, collected = self._run_micro_batches(gb, plan, grad_step, mbs, bucket, gseq, gtok)
        table = collected.table(jnp.zeros((), jnp.float32))
        totals = table.sum(0)
        update = [] if eval_mode else self._optimizer_step(acc, collected.keys, totals, gseq, gtok)
        metrics, mb_metrics, update_values = self._read_step(collected, totals, table, *update)
        loss = metrics.get("loss", 0.0)
        norm, reason = 0.0, None
        if not eval_mode:
            (norm,), (skipped,) = update_values
            if skipped:
                reason = step_skip_reason(float(gseq), float(gtok), loss, norm) or "non_finite_grad_norm"
        # Several processes: a micro batch spans them all, so every process holds the same
        # per-micro-batch values; process 0 alone reports them, so that the Policy's
        # concatenation over workers still sums to the step's value.
        return StepResult(loss, norm, metrics, reason, mb_metrics if self.rank == 0 else {})

    def _run_micro_batches(
        self, gb: Mapping[str, np.ndarray], plan: Any, grad_step: Any, mbs: int, bucket: int, gseq: Any, gtok: Any
    ) -> tuple[Any, MicroBatchMetrics]:
        """Forward and backward of each micro batch (``RowLayouts.train_micro_batches``), the
        gradients accumulated on the device; returns them and the metrics (kept on the
        device: read once per step, in ``_read_step``)."""
        acc = steps.zero_grads(self._trainable(self.params))
        collected = MicroBatchMetrics()
        for args in self.rows.train_micro_batches(gb, plan, mbs, bucket):
            acc, metrics = grad_step(self.params, acc, *args, gseq, gtok)
            collected.add(metrics)
        return acc, collected

    def _optimizer_step(self, acc: Any, keys: list[str], totals: Any, gseq: Any, gtok: Any) -> list[jax.Array]:
        """Queue the jitted update: it applies the accumulated gradients unless the step has
        no valid token or a non-finite loss or gradient norm, in which case params and optimizer
        state stay as they were.  Returns ``[norm, skipped]`` (device arrays, read with the step)."""
        loss = totals[keys.index("loss")] if "loss" in keys else 0.0
        valid = bool(gseq > 0 and gtok > 0)
        self.params, self.opt_state, norm, skipped = self._apply_updates(self.params, self.opt_state, acc, loss, valid)
        return [norm, skipped]

    def _grad_step(self, loss_fn: Any):
        # Keyed by the loss's configuration, not its identity: every Policy.train call ships
        # a fresh (unpickled) copy of the same loss, which must reuse the compiled program.
        key = steps.loss_key(loss_fn) + (() if self.rows.plain else ("layout",))
        if key not in self._grad_steps:
            # Only the grad steps remat: a forward-only step has no backward to save memory for.
            apply_fn = functools.partial(self.apply_fn, remat=True) if self.remat else self.apply_fn
            grad_shardings = self._trainable(self.shardings)
            if self._exact:
                self._grad_steps[key] = make_exact_grad_step(
                    self.model, loss_fn, self.temperature, self.mesh, grad_shardings
                )
            elif self.rows.plain:
                self._grad_steps[key] = steps.make_grad_step(
                    apply_fn,
                    loss_fn,
                    self.temperature,
                    grad_shardings,
                    self.trainable,
                    self.router_aux,
                    replay=self.cfg.moe.routing_replay.enabled,
                )
            else:
                self._grad_steps[key] = steps.make_layout_grad_step(
                    apply_fn, loss_fn, self.temperature, self.rows.cp, grad_shardings, self.trainable, self.router_aux
                )
        return self._grad_steps[key]

    # ------------------------------------------------------------------ generation
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """KV-cache decoding on the sharded params, ``policy.generation_batch_size`` rows at a time;
        ``GenerationOutputSpec`` as torch tensors."""
        import torch

        with before_collectives():
            self._check_batch(data, self.hf_config.vocab_size)
            args = batch_generation_args(self.cfg, self.tokenizer, self.hf_config.eos_token_id, data)
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
                min_new_tokens=args.min_new_tokens,
                row_budgets=args.row_budgets,
                rng=self._generate_calls,
                stop_strings=data.get("stop_strings"),
                sample_seeds=None if seeds is None else np.asarray(seeds),
                batch_size=self.cfg.generation_batch_size,
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

    def offload_before_refit(self) -> None:
        """Free device memory for the refit: optimizer state to host memory."""
        self._offload("opt_state")

    def offload_after_refit(self) -> None:
        """The generation engine owns the devices now: params to host memory too."""
        self._offload("params")
        self._offload("opt_state")

    def _offload(self, name: str) -> None:
        """Move ``self.<name>`` (a sharded pytree) to host memory (``sharding.stash``); the device
        buffers are freed when the last reference goes."""
        tree = getattr(self, name)
        if tree is None:
            return
        self._host_copies[name] = stash(tree)
        setattr(self, name, None)

    def _reload(self, name: str) -> None:
        if name in self._host_copies:
            setattr(self, name, unstash(*self._host_copies.pop(name)))

    def iter_full_weights(self, dtype: Any = None, merged: bool = True) -> Iterator[tuple[str, Any]]:
        """``(hf_name, full tensor)`` in the HF layout and ``dtype`` (None: the params'), one
        tensor at a time, in ``expected_entries`` order.

        The HF layout (vocab cut, transpose) and the cast run on the devices, shard by shard
        (``hf_mapping.hf_layout``, one program per distinct shape: every layer shares it); then
        the tensor leaves them once (``sharding.off_device``).  The old path copied the whole fp32
        model to the host and transposed and cast it there (9.7 s for 1.2 B params next to an
        H100, plus as much again for ``prepare_refit_info``, which read the same stream)."""
        self._reload("params")
        flat = flat_values(self.params)
        if self.lora and merged:  # LoRA: each adapted kernel merged (W + scale * B @ A) before the layout
            flat = merged_flat(flat, self.lora, self.lora_scale)
        cast = None if dtype is None else jnp.dtype(dtype)
        for e in expected_entries(self.model_cfg):
            full = self._hf_layout(entry_value(flat, e), e.transform, e.vocab_dim, self.model_cfg.vocab_size, cast)
            yield e.hf_name, off_device(full)

    # LoRA adapter-only refit: the base unmerged, the adapters under PEFT's names.
    def _iter_base_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        return self.iter_full_weights(dtype, merged=False)

    def _adapter_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """A [r, in] and B [out, r] per adapted module (HF layout), in ``self.lora`` order."""
        dtype, rank = jnp.dtype(self.model.param_dtype).name, self.cfg.lora.rank
        shapes = {e.hf_name[: -len(".weight")]: e.hf_shape for e in expected_entries(self.model_cfg)}
        info: dict[str, tuple[tuple[int, ...], str]] = {}
        for item in self.lora:
            out_flat, in_flat = shapes[item.module]
            name_a, name_b = adapter_names(item.module)
            info[peft_name(name_a)] = ((rank, in_flat), dtype)
            info[peft_name(name_b)] = ((out_flat, rank), dtype)
        return info

    def _iter_adapter_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """``lora_a`` [*in, r] -> A [r, in] and ``lora_b`` [r, *out] -> B [out, r] (what the HF
        export writes), cast and moved off the devices one at a time."""
        self._reload("params")
        flat = flat_values(self.params)
        cast = jnp.dtype(dtype) if dtype is not None else None
        for item in self.lora:
            base = item.kernel_path[:-1]
            a, b = flat[base + ("lora_a",)], flat[base + ("lora_b",)]
            name_a, name_b = adapter_names(item.module)
            for name, hf in ((name_a, a.reshape(-1, a.shape[-1]).T), (name_b, b.reshape(b.shape[0], -1).T)):
                yield peft_name(name), off_device(hf if cast is None else hf.astype(cast))

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
            what=f"model {self.cfg.model_name!r}",
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

            nnx.update(self.model, params)  # self.model is a scratch copy: the steps use self.params
            if self.lora:
                self._write_lora_export(params, path)
            save_hf_checkpoint(self.model, self.hf_config, path)
            if save_tokenizer and self.tokenizer is not None:
                self.tokenizer.save_pretrained(path)

    def _write_lora_export(self, params: Any, path: str) -> None:
        """Merge the adapters into ``self.model``'s kernels (what ``save_hf_checkpoint`` writes)
        and write the PEFT adapter directory beside them (``LORA_ADAPTER_DIR``)."""
        import torch

        flat = flat_values(params)
        merged = merged_flat(flat, self.lora, self.lora_scale)
        for item in self.lora:
            module_at(self.model, item.kernel_path[:-1]).kernel.set_value(
                jnp.asarray(np.asarray(merged[item.kernel_path]))
            )
        adapters = {}
        for item in self.lora:
            base = item.kernel_path[:-1]
            a, b = np.asarray(flat[base + ("lora_a",)]), np.asarray(flat[base + ("lora_b",)])
            name_a, name_b = adapter_names(item.module)
            adapters[name_a] = torch.from_numpy(np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T))  # [r, in]
            adapters[name_b] = torch.from_numpy(np.ascontiguousarray(b.reshape(b.shape[0], -1).T))  # [out, r]
        write_peft_adapter(os.path.join(path, LORA_ADAPTER_DIR), self._peft_config(), adapters)

    # ------------------------------------------------------------------ profiling
    def start_gpu_profiling(self) -> None:
        self._profile_dir = str(self._profile_root() / f"jax_rank{self.rank}")
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
