"""``JaxPolicyWorker``: the JAX engine's hooks of the shared worker skeleton, on a flax model
sharded over a JAX mesh.

One worker per host owns all of that host's devices (several hosts join one
``jax.distributed`` runtime, the coordinator being the worker group's MASTER_ADDR/PORT).
Data arrives as ``BatchedDataDict``s of torch tensors, is converted at this boundary to
host numpy, padded to a width of the ladder (``widths.bucket_for``) and placed on the mesh.

Several processes (``jax.process_count() > 1``): each feeds its own rows of every micro
batch (``shard_host_batch``), gets its own rows of the outputs back, and the loss's valid
counts are summed over the processes; refit tensors and the HF export are gathered
(``sharding.host_copy``), offloaded state and the reference weights keep this process's
shards (``sharding.HostShards``).  Context parallelism, sequence packing and generation on
the policy workers are refused there (``processes.check_multi_process``).  One process runs exactly
the single-host code.

Context parallelism (``parallel.context_parallel_size`` > 1: the mesh's ``cp`` axis splits
the sequence) and sequence packing (``policy.sequence_packing``: the driver's bins, or a
local plan, become packed rows; ``fsdp`` bins per micro batch) run through the
explicit-layout steps (``steps.make_layout_*``); without either, the original steps run
unchanged.  ``row_layouts.RowLayouts`` turns host rows into each layout's micro batches.
Generation decodes with the sequence replicated (``DECODE_RULES``).

The skeleton (train loop, logprob and generate preparation, offload states, checkpoints and
exports, adapter refit, profiling, shutdown) is the torch workers' too:
``core.policy.worker_base.PolicyWorkerBase``.  This class supplies the JAX hooks (jitted steps,
an update that decides on the device whether to apply a step, host <-> device moves, the
profiler); full weights, orbax checkpoints and refit streams are ``weights_io.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax_pjit import steps
from backends.jax_pjit.exact_generate import make_exact_decode_fns
from backends.jax_pjit.exact_steps import make_exact_logprob_step
from backends.jax_pjit.generate import generate as jax_generate
from backends.jax_pjit.generate import make_decode_fns
from backends.jax_pjit.grad_step_choice import make_worker_grad_step
from backends.jax_pjit.hf_mapping import from_pretrained, hf_layout
from backends.jax_pjit.lora import LoRAParam, apply_lora, split_trainable
from backends.jax_pjit.models import logical_axes_tree, make_apply_fn
from backends.jax_pjit.optim import build_optax, build_schedule, init_optimizer_state, set_learning_rate
from backends.jax_pjit.optimizer_params import AdamWParams, rebuilt_optimizer, with_adamw_params
from backends.jax_pjit.param_placement import place_params
from backends.jax_pjit.processes import check_multi_process, device_id, device_info, init_jax_distributed, on_mesh
from backends.jax_pjit.row_layouts import RowLayouts
from backends.jax_pjit.sharding import make_mesh, stash, unstash
from backends.jax_pjit.spec import settings as jax_settings
from backends.jax_pjit.weights_io import JaxWeightsIO
from core.data import BatchedDataDict
from core.losses.contract import loss_cache_key
from core.losses.metrics import MicroBatchMetrics
from core.losses.router_aux import router_aux_for
from core.models.lora import lora_scale
from core.policy.config import PolicyConfig
from core.policy.generation_args import GenerationArgs
from core.policy.matmul_precision import resolve_matmul_precision
from core.policy.preflight import check_tensor_parallel_fits, check_tokenizer_fits
from core.policy.worker_base import OPTIMIZER_MISSING, REFERENCE_MISSING, PolicyWorkerBase, TrainCall, step_skip_reason

if TYPE_CHECKING:
    import optax

    from core.interfaces import LossFunction

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class JaxTrainCall(TrainCall):
    """A JAX ``train`` call: its global batches are ``(host rows, plan)``, the plan a packing
    plan, a dynamic-batching ``DynamicChunk`` or None (fixed micro batches)."""

    grad_step: Any  # the compiled micro-batch step (``_grad_step``)
    bucket: int  # the padded width every micro batch shares (one compiled shape)


class JaxPolicyWorker(JaxWeightsIO, PolicyWorkerBase[JaxTrainCall]):
    """One host of a JAX policy; constructed inside a Ray actor by ``core.policy.Policy``."""

    def _build(self, resume: bool, init_optimizer: bool, init_reference_model: bool) -> None:
        init_jax_distributed()
        self.rank = jax.process_index()
        self.mesh = make_mesh(self.cfg)
        # How host rows become device micro batches: plain, context-parallel or packed rows.
        self.rows = RowLayouts(self.cfg, self.mesh)
        check_multi_process(self.cfg, self.mesh, self.rows.packing is not None)
        self.compute_dtype = DTYPES[self.cfg.precision]
        # policy.matmul_precision, entered by _on_mesh around every device step (see there).
        self.matmul_precision = resolve_matmul_precision(self.cfg)
        # policy.activation_checkpointing: remat every decoder layer of the grad steps.
        self.remat = self.cfg.activation_checkpointing

        # A vocabulary tp does not divide is zero-padded inside the backend (embedding rows /
        # lm_head columns, masked logits); model_cfg.vocab_size and everything leaving the
        # worker (logprobs, refit, HF export) keep the real vocabulary.
        model, self.model_cfg, self.hf_config = from_pretrained(
            self.cfg.model_name,
            dtype=self.compute_dtype,
            param_dtype=jnp.float32,
            tp=self.mesh.shape["tp"],
            make_vocab_size_divisible_by=int(self.cfg.make_vocab_size_divisible_by or 1),
            moe_dispatch=jax_settings(self.cfg).moe_dispatch,
            expert_parallel=self.cfg.parallel.expert_parallel_size,
        )
        check_tokenizer_fits(self.tokenizer, self.hf_config, self.cfg.model_name)
        check_tensor_parallel_fits(self.hf_config, self.mesh.shape["tp"], "policy.parallel.tensor_parallel_size")
        # policy.lora: adapters on the targeted Dense layers; only they train (``self.trainable``).
        # A resumed run (weights_path) takes them from its checkpoint, not policy.lora.adapter_path.
        lora = self.cfg.lora
        self.lora = apply_lora(model, self.model_cfg, lora, resume=resume) if lora.enabled else []
        self.lora_scale = lora_scale(self.cfg.lora.alpha, self.cfg.lora.rank, self.cfg.lora.use_rslora)
        self.trainable = LoRAParam if self.lora else None
        # A MoE model's training steps add the router's load-balancing loss (policy.moe).
        self.router_aux = router_aux_for(self.cfg.moe.router_aux_loss_coef, self.hf_config)
        self.model = model
        # policy.numerics exact: the exact forward (models.exact) in the steps and the sampler.
        self._exact = self.cfg.numerics == "exact"
        self.apply_fn, params = make_apply_fn(model)
        # A storage axis that does not divide a weight's preferred dim is moved (param_placement).
        self.shardings = place_params(params, logical_axes_tree(params), self.mesh)
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
        self._decode_fns = make_exact_decode_fns(model, self.mesh) if self._exact else make_decode_fns(model)
        # Refit: HF layout + cast on the devices, each shard where it is (no gather yet).
        self._hf_layout = jax.jit(hf_layout, static_argnums=(1, 2, 3, 4))
        self._host_copies: dict[str, tuple[Any, Any]] = {}  # offloaded state, as sharding.stash returns it
        self._generate_calls = 0

    @classmethod
    def logits_loss_refusal(cls, cfg: PolicyConfig, context_parallel: int) -> str | None:
        """Every JAX grad step differentiates the token logprobs: there is no full-logits path."""
        return (
            "the jax_pjit backend computes every loss from the token logprobs (it has no full-logits loss "
            "path); use a core.losses loss"
        )

    @property
    def _data_parallel_size(self) -> int:
        return jax.process_count()  # the driver shards over hosts; each splits its rows over its devices

    @property
    def _data_parallel_devices(self) -> int:
        return int(self.mesh.shape["fsdp"])

    @property
    def _context_parallel_size(self) -> int:
        return int(self.mesh.shape["cp"])

    @property
    def _has_optimizer(self) -> bool:
        return self.tx is not None

    def _check_micro_batch_split(self, mbs: int, field: str) -> None:
        self.rows.check_rows_split(mbs, field)

    def _trainable(self, tree: Any) -> Any:
        """The part of a params-shaped tree that trains: all of it, or with LoRA the adapters."""
        return tree if self.trainable is None else split_trainable(tree, self.trainable)[0]

    # ------------------------------------------------------------------ identity
    def report_device_id(self) -> str:
        return device_id()

    def get_gpu_info(self) -> dict[str, Any]:
        return device_info(self.rank, self.mesh)

    def reset_peak_memory_stats(self) -> None:
        return None  # XLA exposes no reset for its peak counter; get_gpu_info reports it as is

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

    def _on_mesh(self, decode: bool = False) -> contextlib.AbstractContextManager[None]:
        """Every jitted step of this worker runs in this block (``processes.on_mesh``)."""
        return on_mesh(self.mesh, self.matmul_precision, decode)

    # ------------------------------------------------------------------ inference hooks
    def _score_rows(self, data: BatchedDataDict, mbs: int, record_routing: bool) -> tuple[Any, Any]:
        """Plain rows through the original logprob step (with routed experts when the policy
        records its routing); context-parallel or packed rows through the layout step."""
        self._reload("params")
        ids, lengths = data["input_ids"].numpy(), data["input_lengths"].numpy()
        if self.rows.plain:
            return self._plain_logprobs(ids, lengths, mbs, self.rows.dynamic_segments(data))
        with self._on_mesh():
            return self.rows.layout_logprobs(self._layout_logprob_step, self.params, ids, lengths, data, mbs), None

    def _plain_logprobs(
        self, ids: np.ndarray, lengths: np.ndarray, mbs: int, plan: list[tuple[int, int, int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """[N, S] logprobs of plain right-padded rows and (a MoE policy recording its routing)
        their ``routed_experts`` [N, S, sparse layers, top_k]: ``mbs`` rows per micro batch at
        the batch's bucket, or with ``plan`` (dynamic batching: ``(start, end, length)`` of each
        micro batch) each planned micro batch at its own shape (``RowLayouts.dynamic_shape``)."""
        width = ids.shape[1]
        if plan is None:
            bucket = self.rows.bucket(width)
            shapes = [(start, min(start + mbs, len(ids)), mbs, bucket) for start in range(0, len(ids), mbs)]
        else:
            shapes = [(start, end, *self.rows.dynamic_shape(end - start, length)) for start, end, length in plan]
        pending = []
        with self._on_mesh():
            for start, end, rows, cols in shapes:
                host = steps.pad_micro_batch(
                    {"input_ids": ids[start:end, :cols], "input_lengths": lengths[start:end]}, rows, cols
                )
                dev = self.rows.device_batch(host)
                pending.append(self._logprob_step(self.params, dev["input_ids"], dev["input_lengths"]))
        # Read only once every micro batch is queued: a read inside the loop would leave the
        # device idle while the host copies the result and prepares the next micro batch.
        per_step = 1 if self.route_top_k is None else 2  # (logprobs[, routed_experts]) per micro batch
        read = self.rows.host_rows_of([x for out in pending for x in (out if per_step > 1 else (out,))])

        def joined(j: int, empty: np.ndarray) -> np.ndarray:
            parts = []
            for i, (start, end, _, _) in enumerate(shapes):
                part = read[i * per_step + j][: end - start, :width]
                pad = [(0, 0), (0, width - part.shape[1])] + [(0, 0)] * (part.ndim - 2)
                parts.append(np.pad(part, pad))  # a planned micro batch narrower than the batch
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

    # ------------------------------------------------------------------ training hooks
    @contextlib.contextmanager
    def _train_call(
        self, data: BatchedDataDict, loss_fn: LossFunction, local_gbs: int, mbs: int, eval_mode: bool
    ) -> Iterator[JaxTrainCall]:
        """Host rows cut into global batches (with their packing plans), the compiled step,
        and the learning rate of this call set in the optimizer state."""
        self.prepare_for_training()
        host = {k: v.numpy() for k, v in data.items() if hasattr(v, "numpy")}
        plans = (
            self.rows.packing_plan(data, host["input_lengths"], local_gbs, "train_mb_tokens")
            if self.rows.packing is not None
            else self.rows.dynamic_plan(data, local_gbs)
        )
        batches = [
            ({k: v[g * local_gbs : (g + 1) * local_gbs] for k, v in host.items()}, plans[g] if plans else None)
            for g in range(len(host["input_ids"]) // local_gbs)
        ]
        call = JaxTrainCall(
            loss_fn, mbs, eval_mode, batches, self._grad_step(loss_fn), self.rows.bucket(host["input_ids"].shape[1])
        )
        with self._on_mesh():
            if not eval_mode:
                if self.schedule is None:  # _check_train_call refused training without an optimizer
                    raise RuntimeError(OPTIMIZER_MISSING)
                self.opt_state = set_learning_rate(self.opt_state, self.schedule(self.train_step))
            yield call

    def _global_valid_counts(self, gb: tuple[Mapping[str, np.ndarray], Any]) -> tuple[Any, Any]:
        rows, _ = gb
        return steps.global_valid_counts(rows["sample_mask"], rows.get("token_mask"), rows["input_lengths"])

    def _run_micro_batches(
        self, call: JaxTrainCall, gb: tuple[Mapping[str, np.ndarray], Any], gseq: Any, gtok: Any
    ) -> tuple[Any, MicroBatchMetrics]:
        """Forward and backward of each micro batch (``RowLayouts.train_micro_batches``), the
        gradients accumulated on the device; returns them and the metrics (kept on the
        device: read once per step, in ``_read_step``)."""
        rows, plan = gb
        acc = steps.zero_grads(self._trainable(self.params))
        collected = MicroBatchMetrics()
        for args in self.rows.train_micro_batches(rows, plan, call.mbs, call.bucket):
            acc, metrics = call.grad_step(self.params, acc, *args, gseq, gtok)
            collected.add(metrics)
        return acc, collected

    def _device_scalar(self) -> jax.Array:
        return jnp.zeros((), jnp.float32)

    def set_optimizer_params(self, params: AdamWParams) -> None:
        """AdamW's settings for the next steps: the lr as the schedule; others rebuild the chain."""
        if self.tx is None:
            raise RuntimeError(OPTIMIZER_MISSING)
        self.prepare_for_training()  # the optimizer state on the devices
        if params.constants() != getattr(self, "_adam_constants", None):  # else only the lr moves
            with self.mesh:
                self.tx, self.opt_state, self._apply_updates = rebuilt_optimizer(
                    params, self.opt_state, self._trainable(self.params), self.shardings, self.trainable
                )
            self._adam_constants = params.constants()
        self.cfg, self.schedule = with_adamw_params(self.cfg, params), build_schedule(None, params.lr)

    def _queue_optimizer_step(self, grads: Any, keys: list[str], totals: Any, gseq: Any, gtok: Any) -> list[Any]:
        """Queue the jitted update: it applies the accumulated gradients unless the step has
        no valid token or a non-finite loss or gradient norm, in which case params and optimizer
        state stay as they were -- decided on the device, so unlike torch the update is queued
        before the step's one host read.  Returns ``[norm, skipped]`` (read with the step)."""
        loss = totals[keys.index("loss")] if "loss" in keys else 0.0
        valid = bool(gseq > 0 and gtok > 0)
        self.params, self.opt_state, norm, skipped = self._apply_updates(
            self.params, self.opt_state, grads, loss, valid
        )
        return [norm, skipped]

    def _finish_optimizer_step(self, read: list[list[float]], loss: float, gseq: Any, gtok: Any):
        """The read only reports what the update did."""
        (norm,), (skipped,) = read
        reason = (step_skip_reason(float(gseq), float(gtok), loss, norm) or "non_finite_grad_norm") if skipped else None
        return norm, reason

    @property
    def _reports_micro_batches(self) -> bool:
        # Several processes: a micro batch spans them all, so every process holds the same
        # per-micro-batch values; process 0 alone reports them, so that the Policy's
        # concatenation over workers still sums to the step's value.
        return self.rank == 0

    def _advance_schedule(self) -> None:
        self.train_step += 1

    def _learning_rate(self) -> float | None:
        return self.schedule(self.train_step) if self.schedule is not None else None

    def _grad_step(self, loss_fn: Any):
        # Keyed by the loss's cache_key(), not its identity: every Policy.train call ships a
        # fresh (unpickled) copy of the same loss, which must reuse the compiled program, and a
        # loss with any other setting must not (the program closes over the loss).
        key = (type(loss_fn).__name__, loss_cache_key(loss_fn), self.rows.plain)
        if key not in self._grad_steps:
            self._grad_steps[key] = make_worker_grad_step(
                loss_fn,
                exact_model=self.model if self._exact else None,
                apply_fn=self.apply_fn,
                remat=self.remat,
                rows=self.rows,
                temperature=self.temperature,
                grad_shardings=self._trainable(self.shardings),
                trainable=self.trainable,
                router_aux=self.router_aux,
                replay=self.cfg.moe.routing_replay.enabled,
            )
        return self._grad_steps[key]

    # ------------------------------------------------------------------ generation hook
    def _generate_rows(self, data: BatchedDataDict, args: GenerationArgs, greedy: bool) -> BatchedDataDict:
        """KV-cache decoding on the sharded params; ``GenerationOutputSpec`` as torch tensors."""
        from core.policy.worker_inference import host_tensor

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
                tokenizer=self.tokenizer,
                **args.limits(),
                rng=self._generate_calls,
                stop_strings=data.get("stop_strings"),
                sample_seeds=None if seeds is None else np.asarray(seeds),
                batch_size=self.cfg.generation_batch_size,
            )
        return BatchedDataDict({k: host_tensor(v) for k, v in out.items()})

    # ------------------------------------------------------------------ placement hooks
    def _move_weights(self, on_device: bool) -> None:
        self._reload("params") if on_device else self._offload("params")

    def _move_optimizer_state(self, on_device: bool) -> None:
        self._reload("opt_state") if on_device else self._offload("opt_state")

    def _offload(self, name: str) -> None:
        """Move ``self.<name>`` (a sharded pytree) to host memory (``sharding.stash``); the device
        buffers are freed when the last reference goes.  Not on CPU devices: their buffers are
        host memory already, so the move would free nothing for a colocated engine and cost
        two copies of the state per step (out before the refit, back before the next call)."""
        tree = getattr(self, name)
        if tree is None or not self._offload_frees_device_memory:
            return
        self._host_copies[name] = stash(tree)
        setattr(self, name, None)

    @property
    def _offload_frees_device_memory(self) -> bool:
        return self.mesh.devices.flat[0].platform != "cpu"

    def _reload(self, name: str) -> None:
        if name in self._host_copies:
            setattr(self, name, unstash(*self._host_copies.pop(name)))

    # ------------------------------------------------------------------ profiling and teardown hooks
    def _start_profiler(self, root: Path) -> str:
        profile_dir = str(root / f"jax_rank{self.rank}")
        jax.profiler.start_trace(profile_dir)
        return profile_dir

    def _stop_profiler(self, handle: str) -> str:
        jax.profiler.stop_trace()
        return handle

    def _leave_process_group(self) -> None:
        """Several processes: leave the ``jax.distributed`` runtime together.  The group calls
        shutdown on every worker at once; ``jax.distributed.shutdown`` waits for all of them, so
        the coordinator (process 0) does not vanish while another process is still attached
        to it -- which aborts that process (SIGABRT in its coordination-service agent)."""
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()


if TYPE_CHECKING:  # the type checker holds this worker to the driver's contract
    from core.policy.worker_protocol import PolicyWorker

    _contract: type[PolicyWorker] = JaxPolicyWorker
