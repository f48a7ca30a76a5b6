"""``TorchPolicyWorker``: everything the FSDP1 and DTensor policy workers have in common.

A backend subclass supplies only what differs between the engines:

* ``_parallel_dims()``      -- the (dp, cp, tp) split of the world,
* ``_parallelize(model)``   -- wrap/shard the HF module; returns the module to call,
* ``_clip_grad_norm(max)``  -- global gradient norm (FSDP1 flat params vs DTensors),
* ``_iter_stored_weights()`` -- ``(name, full tensor)`` pairs, gathered shard by shard,
* ``_no_gradient_sync()`` / ``_keep_params_gathered()`` -- how the engine skips per-micro-
  batch collectives (gradient reduction, parameter re-gathering),
* optionally ``_seq_multiple`` (sequence parallelism pads the width to a multiple of tp).

The rest -- micro-batch loop, global loss normalisation, temperature, logprobs, reference
swap, optimizer/scheduler, checkpoints, offloading, profiling -- is written once here.
The micro-batch loops issue no host synchronisation: values stay on the device and are
read once per optimizer step / call (``core.losses.metrics``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backends.torch_common import checkpoint as ckpt
from backends.torch_common.batches import (
    batch_to_device,
    global_valid_counts,
    micro_batches,
    model_inputs,
    pad_columns,
    reshaped_rows,
    to_device,
)
from backends.torch_common.dist_env import (
    device_id,
    device_info,
    empty_cache,
    init_torch_distributed,
    reset_peak_memory,
)
from backends.torch_common.exact_generation import exact_generate
from backends.torch_common.exact_ops import apply_exact_numerics
from backends.torch_common.generation import GenerationReplica, hf_generate
from backends.torch_common.lora import apply_lora, trainable_parameters
from backends.torch_common.memory_trade import full_copies_fit, weight_bytes
from backends.torch_common.model_loading import as_torch_dtype, hf_param_meta, load_hf_model, torch_dtype
from backends.torch_common.moe import RouterRecorder
from backends.torch_common.optim import build_optimizer, build_scheduler, current_lr, move_optimizer_state
from backends.torch_common.precision import apply_matmul_precision, matmul_precision_state
from backends.torch_common.reference import ReferenceWeights, local_shards
from core.data import BatchedDataDict
from core.data.context_parallel import attention_allowed
from core.data.sequence_packing import PackedRow
from core.distributed.recoverable import before_collectives
from core.interfaces import TrainResult
from core.kernels import apply_temperature, logprobs_to_sequence_layout, next_token_logprobs
from core.kernels.logprobs import logprobs_from_logits
from core.kernels.moe import routed_experts_of
from core.kernels.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_next_token_logprobs
from core.losses.metrics import MicroBatchMetrics
from core.losses.router_aux import router_aux_for
from core.models.lora import is_adapter_name, lora_scale, merge_adapter_stream, peft_name, write_peft_adapter
from core.parallel_dims import ParallelDims
from core.policy.generation_args import batch_generation_args
from core.policy.preflight import check_tokenizer_fits
from core.policy.worker_base import (
    LORA_ADAPTER_DIR,
    OPTIMIZER_MISSING,
    REFERENCE_MISSING,
    PolicyWorkerBase,
    StepResult,
    reports_worker_seconds,
    step_skip_reason,
)
from core.refit.checkpoint_names import checkpoint_refit_info, checkpoint_weights
from core.refit.manifest import tied_aliases

if TYPE_CHECKING:
    from backends.torch_dtensor.context_parallel import ContextParallelRows


class TorchPolicyWorker(PolicyWorkerBase, abc.ABC):
    """One rank of a torch policy; constructed inside a Ray actor by ``core.policy.Policy``.

    Args mirror NeMo RL's workers: ``config`` is the ``policy`` section, ``tokenizer`` an
    HF tokenizer; ``weights_path``/``optimizer_path`` resume from a DCP checkpoint.
    """

    #: Sequence widths are padded to a multiple of this (sequence parallelism sets it to tp).
    _seq_multiple: int = 1
    #: Context-parallel row handling (the DTensor worker sets it when cp > 1).
    _cp_rows: ContextParallelRows | None

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
        super().__init__(config, tokenizer)
        self.device = init_torch_distributed()
        # Before any module exists: every matmul of the run (init included) uses it.
        self.float32_matmul_precision = apply_matmul_precision(self.cfg)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims: ParallelDims = self._parallel_dims()
        # Widths are padded to make_sequence_length_divisible_by as well as to what the layout
        # needs (sequence / context parallelism); the config check keeps the two compatible.
        self._seq_multiple = math.lcm(self._seq_multiple, int(self.cfg.make_sequence_length_divisible_by))
        self.compute_dtype = torch_dtype(self.cfg.precision)

        hf_model = load_hf_model(self.cfg.model_name)
        check_tokenizer_fits(tokenizer, hf_model.config, self.cfg.model_name)
        self._exact = self.cfg.numerics == "exact"
        if self._exact:  # before any wrapping: FSDP / fully_shard wrap the exact layers
            apply_exact_numerics(hf_model)
        self.model_config = hf_model.config
        # policy.lora: targeted linears become LoRALinear before any sharding; only adapters train.
        # A resumed run (weights_path) takes them from its checkpoint, not policy.lora.adapter_path.
        self.lora_modules = (
            apply_lora(hf_model, self.cfg.lora, self.rank, self.device, resume=bool(weights_path))
            if self.cfg.lora.enabled
            else []
        )
        self.lora_scale = lora_scale(self.cfg.lora.alpha, self.cfg.lora.rank, self.cfg.lora.use_rslora)
        # Every stored weight, adapters included, in state-dict order (a base weight, then its
        # A and B); param_meta: the HF weights refit and export carry (merged).
        self._stored_meta = hf_param_meta(hf_model)
        self.param_meta = {n: m for n, m in self._stored_meta.items() if not is_adapter_name(n)}
        # Tied names (lm_head.weight of a tied model): in the state dict, not sent by refit.
        self._refit_skip = frozenset(tied_aliases(hf_model))
        self.hf_module = hf_model
        # A MoE model's training forward records its router logits for the load-balancing
        # loss (policy.moe).
        self._router_aux = router_aux_for(self.cfg.moe.router_aux_loss_coef, self.model_config)
        self._routers = (
            RouterRecorder(
                hf_model, self.model_config.model_type, bool(getattr(self.model_config, "norm_topk_prob", False))
            )
            if self._router_aux
            else None
        )
        if self._activation_checkpointing():
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = self._parallelize(hf_model)

        self.reference = None
        if init_reference_model:
            self.reference = ReferenceWeights(self._local_weight_shards, pin_memory=self.device.type == "cuda")
        self.optimizer = None
        self.scheduler = None
        if init_optimizer and self.cfg.optimizer:
            # Frozen parameters (LoRA's base weights) get no optimizer state.
            self.optimizer = build_optimizer(self.cfg.optimizer, trainable_parameters(self.model))
            self.scheduler = build_scheduler(self.cfg.scheduler, self.optimizer)
        self.train_step = 0
        self._replica = GenerationReplica(
            self.model_config, self.device, self.compute_dtype, apply_exact_numerics if self._exact else None
        )
        self._profiler: torch.profiler.profile | None = None
        if weights_path:  # the Policy verified the manifests' checksums on the driver already
            self.load_checkpoint(weights_path, optimizer_path, checksums=not _.get("checkpoint_verified", False))

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _parallel_dims(self) -> ParallelDims:
        """The (dp, cp, tp) split of the world."""

    @abc.abstractmethod
    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap/shard the HF module; returns the module to call."""

    @abc.abstractmethod
    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip to ``max_norm`` (None: only measure); the global norm, equal on every rank, as
        a 0-d device tensor (read on the host with the step's other values)."""

    @abc.abstractmethod
    def _no_gradient_sync(self) -> contextlib.AbstractContextManager:
        """Around a micro batch's forward + backward that is not the step's last: gradients
        accumulate locally, unreduced (the last micro batch's backward reduces the sum)."""

    @abc.abstractmethod
    def _keep_params_gathered(self) -> contextlib.AbstractContextManager:
        """Around a no-grad pass over several micro batches: each wrapped unit gathers its
        parameters once and keeps them until the block ends (then every copy is freed)."""

    @abc.abstractmethod
    def _iter_stored_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(name, full tensor)`` of every stored weight (``_stored_meta``: with
        LoRA the adapters too) not in ``skip``, on every rank."""

    def iter_full_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: yield ``(hf_name, full tensor)`` for every HF weight, on every rank;
        with LoRA each adapted weight merged (``W + scale * B @ A``, in the stored float32,
        then cast) and the adapters left out."""
        if not self.lora_modules:
            yield from self._iter_stored_weights(dtype, skip)
            return
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(as_torch_dtype(dtype)))
        yield from merge_adapter_stream(self._iter_stored_weights(None, skip), self.lora_modules, self.lora_scale, cast)

    def lora_adapter_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the full adapter weights by name (``<module>.lora_A.weight``), on the host."""
        return {n: t.to("cpu") for n, t in self._iter_stored_weights(None, skip=frozenset(self.param_meta))}

    def _local_weight_shards(self) -> list[torch.Tensor]:
        """The tensors storing this rank's part of the weights (swapped for the reference).

        Called right before the shards are overwritten, so it first drops any unsharded
        copy a wrapper kept from the last forward (FSDP keeps the root's parameters
        gathered after forward): the next forward must gather the new shards, not reuse
        stale full weights.
        """
        self._reshard_all()
        return local_shards(self.model)

    @abc.abstractmethod
    def _reshard_all(self) -> None:
        """Free every gathered (unsharded) parameter copy; backend-specific."""

    @abc.abstractmethod
    def _activation_checkpointing(self) -> bool:
        """Whether the config asks for activation checkpointing."""

    @property
    def _offloading(self) -> bool:
        """Whether parameter CPU offload is on (backends with such an option override this)."""
        return False

    def _offload_params(self, flag: bool, field: str) -> bool:
        """Whether to apply parameter CPU offload: only meaningful with an accelerator (on a
        CPU device the parameters already live in host memory, and FSDP's offload paths
        require an accelerator), so on CPU the option is accepted and ignored, with a note."""
        if flag and self.device.type == "cpu":
            if self.rank == 0:
                warnings.warn(
                    f"{field}=true has no effect on CPU workers: parameters are already in host memory", stacklevel=2
                )
            return False
        return flag

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel process group (default: every rank is data parallel)."""
        world = dist.group.WORLD
        if world is None:  # init_torch_distributed ran in __init__
            raise RuntimeError("torch.distributed is not initialised")
        return world

    # ------------------------------------------------------------------ identity
    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={getattr(self, 'rank', '?')}, dims={getattr(self, 'dims', '?')})"

    def report_device_id(self) -> str:
        return device_id(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        """Device facts plus the float32 matmul / TF32 settings this worker applied."""
        return {**device_info(self.device), **matmul_precision_state()}

    def reset_peak_memory_stats(self) -> None:
        reset_peak_memory(self.device)

    # ------------------------------------------------------------------ logprobs
    def _forward_logits(self, mb: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Temperature-scaled logits [b, s', V] (a vocab-sharded DTensor under TP), the
        device input ids and the unpadded width."""
        ids, mask, seq_len = model_inputs(mb, self.device, self._seq_multiple)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return apply_temperature(logits, self.temperature), ids, seq_len

    @staticmethod
    def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[b, s'-1] log p(x_t | x_<t); vocab-parallel when the logits are vocab-sharded."""
        if isinstance(logits, DTensor):
            return vocab_parallel_next_token_logprobs(logits, ids)
        return next_token_logprobs(logits, ids)

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[b, s] log p(targets) under ``logits`` (vocab-parallel when vocab-sharded)."""
        if isinstance(logits, DTensor):
            return vocab_parallel_logprobs(logits, targets)
        return logprobs_from_logits(logits, targets)

    @property
    def _packing(self) -> bool:
        return self.cfg.sequence_packing.enabled

    @property
    def _rows_reshaped(self) -> bool:
        """Whether micro batches leave the plain padded layout (packing or context parallel)."""
        return self._packing or self.dims.cp > 1

    def _micro_batch_next_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        """[b, S-1] next-token logprobs of one micro batch (S = its width), whatever the layout.

        Plain rows go through HF's own 2-D mask.  Packed rows become one row of several
        sequences (positions restarting, attention confined by segment), context-parallel
        rows are split over the cp ranks; either way the result is mapped back onto the
        micro batch's rows, so every caller sees the plain layout.
        """
        if not self._rows_reshaped:
            logits, ids, seq_len = self._forward_logits(mb)
            return self._next_token_logprobs(logits, ids)[:, : seq_len - 1]
        width = mb["input_ids"].shape[1]
        layout, ids, positions, segments = reshaped_rows(mb, self._packing, self._seq_multiple)
        ids, positions = to_device(ids, self.device), to_device(positions, self.device)
        if self.dims.cp > 1:
            if self._cp_rows is None:  # the DTensor worker sets it whenever cp > 1
                raise RuntimeError("context parallelism without ContextParallelRows")
            next_lp = self._cp_rows.next_logprobs(self._model_logits, self._token_logprobs, ids, positions, segments)
        elif self._varlen_attention:
            # FlashAttention's varlen kernel: HF finds the sequences from the restarting
            # position ids (no mask), and skips the attention between them.
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
            next_lp = self._next_token_logprobs(apply_temperature(logits, self.temperature), ids)
        else:
            cols = np.arange(ids.shape[1])
            allowed = to_device(torch.from_numpy(attention_allowed(cols, cols, segments))[:, None], self.device)
            next_lp = self._next_token_logprobs(self._model_logits(ids, positions, allowed), ids)
        if layout is not None:
            return layout.unpack_next_logprobs(next_lp)
        return next_lp[:, : width - 1]

    @property
    def _varlen_attention(self) -> bool:
        return str(getattr(self.model_config, "_attn_implementation", "")).startswith("flash_attention")

    def _model_logits(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits with explicit positions and a [rows, 1, q, k] bool mask."""
        logits = self.model(input_ids=ids, position_ids=positions, attention_mask=allowed, use_cache=False).logits
        return apply_temperature(logits, self.temperature)

    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"logprobs": [B, S] float32}`` in the ``get_logprobs`` layout, on the host."""
        with before_collectives():
            self._check_batch(data, self.model_config.vocab_size)
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        width = data["input_ids"].shape[1]
        self.model.eval()
        batches = list(micro_batches(data, mbs))
        outs = []
        record = self._routers is not None and self.cfg.moe.records_routing
        routed = []
        with torch.no_grad(), self._gathered_for(len(batches)):
            for mb in batches:
                with self._routing(mb, replay=False) if record else contextlib.nullcontext() as recorded:
                    next_lp = self._micro_batch_next_logprobs(mb)
                lp = logprobs_to_sequence_layout(next_lp, to_device(mb["input_lengths"], self.device))
                outs.append(pad_columns(lp.float(), width))  # stays on the device: no sync here
                if record and self._router_aux is not None and recorded is not None:
                    experts = routed_experts_of(self._router_logits_of(mb, recorded), self._router_aux.top_k)
                    routed.append(torch.nn.functional.pad(experts.short(), (0, 0, 0, 0, 0, width - experts.shape[1])))
        logprobs = torch.cat(outs).cpu() if outs else torch.zeros(0, width)
        out: BatchedDataDict[Any] = BatchedDataDict(logprobs=logprobs)
        if routed:  # policy.moe.records_routing: each token's experts, for the training step
            out["routed_experts"] = torch.cat(routed).cpu()
        return out

    def _gathered_for(self, n_micro_batches: int) -> contextlib.AbstractContextManager:
        """``_keep_params_gathered`` when it saves work and fits (the kept weights are in the
        compute dtype; ``memory_trade.full_copies_fit``), else nothing."""
        nbytes = weight_bytes(self.param_meta, self.compute_dtype)
        if full_copies_fit(self.device, n_micro_batches, nbytes, self._offloading):
            return self._keep_params_gathered()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Within the block the model computes with the reference weights."""
        if self.reference is None:
            raise RuntimeError(REFERENCE_MISSING)
        with self.reference.swapped_in():
            yield

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
        """Optimizer steps over this rank's shard of one or more global batches.

        ``data`` holds ``n * gbs / dp`` rows (``n`` global batches, as sharded by the
        Policy); each global batch is one optimizer step.  A step whose global batch has no
        valid token, or whose global loss or gradient norm is not finite, is skipped on every
        rank (weights and optimizer state unchanged; see ``step_skip_reason``).  The scheduler
        steps once per call if at least one step was applied (a skipped step does not advance
        the schedule, as in Megatron).  Returns rank-identical global values:
        ``global_loss``/``grad_norm`` [n], ``skipped`` [n] / ``skip_reasons`` and ``metrics``
        (each summed over micro batches and ranks = its whole-batch value), plus this rank's
        per-micro-batch metrics in ``all_mb_metrics``.
        """
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        with before_collectives():
            local_gbs = self._check_train_call(
                data,
                loss_fn,
                gbs,
                mbs,
                self.dims.dp,
                self.model_config.vocab_size,
                eval_mode,
                self.optimizer is not None,
            )
        self.model.train(not eval_mode)
        results = []
        for gb_idx in range(data.size // local_gbs):
            gb = data.get_batch(gb_idx, local_gbs)
            results.append(self._train_global_batch(gb, loss_fn, mbs, eval_mode))
        if not eval_mode and self.scheduler is not None and any(r.skip_reason is None for r in results):
            self.scheduler.step()
            self.train_step += 1
        lr = current_lr(self.optimizer) if self.optimizer is not None else None
        return self._train_steps_result(results, lr)

    def _train_global_batch(self, gb: BatchedDataDict, loss_fn: Any, mbs: int, eval_mode: bool) -> StepResult:
        """Forward/backward every micro batch of one global batch, then one optimizer step,
        unless ``step_skip_reason`` (from the all-reduced counts, loss and grad norm, so the
        same on every rank) says to skip it: then the gradients are dropped and neither the
        weights nor the optimizer state move.

        The step's values are read on the host once, after the norm: the skip decision
        needs them, and nothing before it waits for the device."""
        gseq, gtok = global_valid_counts(gb, self.device, self.dp_group)
        if not eval_mode:
            self._require_optimizer().zero_grad(set_to_none=True)
        collected = self._run_micro_batches(gb, loss_fn, mbs, eval_mode, gseq, gtok)
        table = collected.table(gseq)
        totals = self._sum_over_dp(table.sum(0))
        # The norm is measured (and the gradients clipped) before the decision; a skipped
        # step drops the gradients, so a non-finite norm's clipping poisons nothing.
        norm = self._clip_grad_norm(self.cfg.max_grad_norm) if not eval_mode else torch.zeros((), device=self.device)
        head = torch.stack([gseq, gtok, norm.float().to(self.device)])
        metrics, mb_metrics, ((seqs, toks, grad_norm),) = self._read_step(collected, totals, table, head)
        loss = metrics.get("loss", 0.0)
        reason = None if eval_mode else self._optimizer_step(seqs, toks, loss, grad_norm)
        return StepResult(loss, grad_norm, metrics, reason, mb_metrics)

    def _run_micro_batches(
        self, gb: BatchedDataDict, loss_fn: Any, mbs: int, eval_mode: bool, gseq: torch.Tensor, gtok: torch.Tensor
    ) -> MicroBatchMetrics:
        """Forward (and backward) of each micro batch; the metrics stay on the device.

        Gradients are reduced across ranks in the last micro batch's backward only (when
        the full-size unreduced gradients fit, ``memory_trade.full_copies_fit``): the others
        run under ``_no_gradient_sync`` (every rank has the same number of micro batches:
        fixed size, or a lockstep dynamic / packing plan).  An exception in here comes after
        collectives, so the group is torn down (``core.distributed.recoverable``): gradients
        held back by a failed loop never reach a later step.
        """
        batches = list(micro_batches(gb, mbs))
        # Unreduced gradients are accumulated in fp32 (FSDP's reduce dtype), full size.
        defer = not eval_mode and full_copies_fit(
            self.device, len(batches), weight_bytes(self.param_meta, torch.float32), self._offloading
        )
        collected = MicroBatchMetrics()
        for i, mb in enumerate(batches):
            deferred = defer and i < len(batches) - 1
            with (
                torch.no_grad() if eval_mode else contextlib.nullcontext(),
                self._no_gradient_sync() if deferred else contextlib.nullcontext(),
                self._routing(mb, replay=self.cfg.moe.routing_replay.enabled),
            ):
                loss, metrics = self._micro_batch_loss(mb, loss_fn, gseq, gtok)
                if not eval_mode:
                    # FSDP averages gradients over the ranks it shards over (dp, and cp with
                    # context parallelism); the loss is already globally normalised (a sum over
                    # dp ranks; each cp rank holds a partial gradient of the same loss), so
                    # scale by that count to undo the average.
                    (loss * self.dims.dp * self.dims.cp).backward()
            collected.add(metrics)
        return collected

    def _optimizer_step(self, seqs: float, toks: float, loss: float, grad_norm: float) -> str | None:
        """Apply the step, or skip it when ``step_skip_reason`` says so (the gradients are
        dropped: weights and optimizer state do not move).  Returns the skip reason (None:
        applied); the values were all-reduced, so every rank decides alike."""
        reason = step_skip_reason(seqs, toks, loss, grad_norm)
        optimizer = self._require_optimizer()
        if reason is None:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        return reason

    def _require_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of a training call (``_check_train_call`` refused one without it)."""
        if self.optimizer is None:
            raise RuntimeError(OPTIMIZER_MISSING)
        return self.optimizer

    def _micro_batch_loss(self, mb: BatchedDataDict, loss_fn: Any, gseq, gtok):
        """One micro batch's (loss, metrics); a MoE model's router terms join them
        (``core.losses.router_aux``: what ``_routing`` recorded of this forward)."""
        dev_mb = batch_to_device(mb, self.device)
        recorded = self._routers.active if self._routers is not None else None
        if recorded is None or self._router_aux is None:
            return self._loss_of(mb, dev_mb, loss_fn, gseq, gtok)
        loss, metrics = self._loss_of(mb, dev_mb, loss_fn, gseq, gtok)
        return self._router_aux.add_to(loss, metrics, self._router_logits_of(mb, recorded), dev_mb, gseq, gtok)

    def _routing(self, mb: BatchedDataDict, replay: bool) -> contextlib.AbstractContextManager:
        """The routers of a MoE model recorded over one micro batch (``RouterRecorder``), and,
        with ``replay``, sent to the batch's ``routed_experts`` (plain rows: the config check
        keeps replay off packed and context-parallel rows)."""
        if self._routers is None:
            return contextlib.nullcontext()
        if not replay:
            return self._routers.recording()
        routed = to_device(mb["routed_experts"], self.device).long()  # (B, S, L, K)
        rows, width = routed.shape[:2]
        forward_width = -(-width // self._seq_multiple) * self._seq_multiple  # model_inputs' padding
        routed = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, forward_width - width))
        return self._routers.recording(routed.movedim(2, 0).reshape(routed.shape[2], rows * forward_width, -1))

    def _router_logits_of(self, mb: BatchedDataDict, recorded: list[torch.Tensor]) -> torch.Tensor:
        """The routers' logits of ``mb``'s forward on its rows: [layers, B, S, experts].

        The forward ran the layout's rows: packed (one row of every sequence) and/or this
        context-parallel rank's columns; gathered over cp and unpacked here, as the logprobs
        are (``_micro_batch_next_logprobs``)."""
        if self._routers is None:
            raise RuntimeError("router logits of a model without routers")
        rows, width = mb["input_ids"].shape
        packed = PackedRow.build(mb["input_lengths"].tolist(), width, self._seq_multiple) if self._packing else None
        logits = self._routers.stacked(recorded, 1 if packed is not None else rows)  # (L, rows', cols', X)
        if self.dims.cp > 1 and self._cp_rows is not None:
            logits = self._cp_rows.gather_columns(logits, logits.shape[2] * self.dims.cp, dim=2)
        if packed is None:
            return logits[:, :, :width]
        index, _ = packed.token_index()  # padding columns read token 0: masked by the lengths
        return logits[:, 0][:, to_device(torch.from_numpy(index), logits.device)]

    def _loss_of(self, mb: BatchedDataDict, dev_mb: BatchedDataDict, loss_fn: Any, gseq, gtok):
        if hasattr(loss_fn, "loss_from_logprobs"):
            # One logprob path for get_logprobs and train (same temperature, same
            # vocab-parallel kernel): the loss sees exactly what get_logprobs returns.
            return loss_fn.loss_from_logprobs(self._micro_batch_next_logprobs(mb), dev_mb, gseq, gtok)
        if self._rows_reshaped:
            raise ValueError(
                f"loss {type(loss_fn).__name__} has no loss_from_logprobs: with sequence packing or context "
                "parallelism the worker never holds a micro batch's full [b, S, V] logits; use a core.losses loss"
            )
        logits, ids, seq_len = self._forward_logits(mb)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return loss_fn(logits[:, :seq_len], dev_mb, gseq, gtok)

    def _sum_over_dp(self, totals: torch.Tensor) -> torch.Tensor:
        """Each metric summed over the dp ranks, in one all-reduce (stays on the device)."""
        if self.dims.dp > 1 and totals.numel():
            dist.all_reduce(totals, group=self.dp_group)
        return totals

    # ------------------------------------------------------------------ generation
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """HF ``generate`` on this rank's shard, ``policy.generation_batch_size`` rows per call;
        ``GenerationOutputSpec`` on the host."""
        with before_collectives():
            self._check_batch(data, self.model_config.vocab_size)
            args = batch_generation_args(self.cfg, self.tokenizer, self.model_config.eos_token_id, data)
        # The weights are gathered into the replica first: a collective, on every rank.
        module = self._replica.load(self.iter_full_weights(self.compute_dtype))
        sample = exact_generate if self._exact else functools.partial(hf_generate, synced_gpus=False)
        out = sample(
            module,
            data.to(self.device),
            args.gen_cfg,
            greedy=greedy,
            pad_token_id=args.pad_token_id,
            eos_token_ids=args.eos_token_ids,
            tokenizer=self.tokenizer,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.min_new_tokens,
            row_budgets=args.row_budgets,
            batch_size=self.cfg.generation_batch_size,
        )
        return out.to("cpu")

    # ------------------------------------------------------------------ lifecycle
    def prepare_for_lp_inference(self) -> None:
        self.move_to_device(self.model, self.device)
        self.model.eval()
        self.offload_before_refit()

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.move_to_device(self.model, self.device)
        self.model.train()
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)
        empty_cache(self.device)

    def offload_before_refit(self) -> None:
        """Free device memory for the refit: optimizer state goes to the host."""
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu")
        empty_cache(self.device)

    def offload_after_refit(self) -> None:
        """After the refit the engine owns the device: the model goes to the host too."""
        self.move_to_cpu(self.model)
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu")
        empty_cache(self.device)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        return model.to(device)

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.device.type != "cuda":
            raise RuntimeError("move_to_cuda: this worker has no CUDA device")
        return self.move_to_device(model, self.device)

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.move_to_device(model, "cpu")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Collective: DCP shards of the model (and optimizer + scheduler + step)."""
        extra: dict[str, Any] = {"train_step": self.train_step}
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        ckpt.save_dcp(self.model, weights_path, self.optimizer, optimizer_path, extra, train_step=self.train_step)
        self._save_tokenizer(tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None, checksums: bool = True) -> None:
        """Collective: verified DCP load (manifest, kinds, scheduler file, keys and shapes
        checked on rank 0 before any shard is read; ``CheckpointError`` naming the cause)."""
        self._reshard_all()  # the load writes shards; no stale gathered copy may survive
        extra = ckpt.load_dcp(
            self.model,
            weights_path,
            self.optimizer,
            optimizer_path,
            checksums=checksums,
            what=f"model {self.cfg.model_name!r}",
        )
        if "scheduler" in extra and self.scheduler is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        self.train_step = extra.get("train_step", self.train_step)

    def save_hf_checkpoint(self, path: str, save_tokenizer: bool = False) -> None:
        """Collective: gather full weights; rank 0 writes an HF safetensors checkpoint."""
        state = {}
        for name, tensor in self.iter_full_weights():
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            ckpt.write_hf_checkpoint(self.hf_module, state, path, self.tokenizer if save_tokenizer else None)
        if self.lora_modules:
            adapters = self.lora_adapter_weights()
            if self.rank == 0:
                write_peft_adapter(os.path.join(path, LORA_ADAPTER_DIR), self._peft_config(), adapters)
        dist.barrier()

    # ------------------------------------------------------------------ refit (source side)
    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (full shape, dtype) of every weight the refit stream will carry (tied
        aliases left out: the engine's receiver loads them from the weight they share), in
        the checkpoint format: fused experts one tensor per expert (``core.refit.checkpoint_names``)."""
        return checkpoint_refit_info({n: meta for n, meta in self.param_meta.items() if n not in self._refit_skip})

    def _refit_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        return checkpoint_weights(self.iter_full_weights(dtype, skip=self._refit_skip))

    # LoRA adapter-only refit: the base unmerged, the adapters under PEFT's names.
    def _stored_order(self) -> list[str]:
        """Stored weight names in the order ``_iter_stored_weights`` yields them."""
        return list(self._stored_meta)

    def _iter_base_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        adapters = frozenset(n for n in self._stored_meta if is_adapter_name(n))
        cast = None if dtype is None else as_torch_dtype(dtype)
        return checkpoint_weights(self._iter_stored_weights(cast, self._refit_skip | adapters))

    def _adapter_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {peft_name(n): self._stored_meta[n] for n in self._stored_order() if is_adapter_name(n)}

    def _iter_adapter_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        cast = None if dtype is None else as_torch_dtype(dtype)
        for name, tensor in self._iter_stored_weights(cast, skip=frozenset(self.param_meta)):
            yield peft_name(name), tensor

    # ------------------------------------------------------------------ profiling
    def start_gpu_profiling(self) -> None:
        """Start a torch.profiler trace (CPU activity, plus CUDA on GPU)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = self._profiler = profile(activities=activities, record_shapes=True)
        profiler.__enter__()

    def stop_gpu_profiling(self) -> str | None:
        """Stop the trace and write it as Chrome trace JSON; returns the file path.

        Directory: ``$DUALRL_PROFILE_DIR`` (default ``./profiles``); one file per rank.
        """
        if self._profiler is None:
            return None
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        out_dir = self._profile_root()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{type(self).__name__}_rank{self.rank}_{int(time.time())}.json"
        prof.export_chrome_trace(str(path))
        return str(path)

    def shutdown(self) -> bool:
        self.finish_refit_stream()  # the group ray.kill()s us next: exit handlers never run
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
