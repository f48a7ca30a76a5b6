"""``TorchPolicyWorker``: the torch engine's hooks of the shared worker skeleton, for FSDP1 and DTensor.

The skeleton -- ``train`` and its global-batch step, ``get_logprobs`` and ``generate``
preparation, the offload states, checkpoints and the HF / PEFT export, adapter refit,
profiling, shutdown -- is ``core.policy.worker_base.PolicyWorkerBase``.  This class supplies
what torch does for it: the micro-batch loop (forward, backward, deferred gradient reduction),
the optimizer and scheduler, DCP checkpoints, device moves, the torch profiler.  The forward to
logprobs on every row layout is ``logprob_pass.py``, MoE routing ``routing.py``, full weights,
checkpoints and refit streams ``weights_io.py``.

A backend subclass supplies only what differs between the torch engines
(``sharding_hooks.TorchShardingHooks``: the world's split, the wrapping, gradient clipping,
full-weight gathers, skipping per-micro-batch collectives), and optionally ``_seq_multiple``
(sequence parallelism pads the width to a multiple of tp).  The micro-batch loops issue no host
synchronisation: values stay on the device and are read once per optimizer step / call.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backends.torch_common.batches import batch_to_device, global_valid_counts, micro_batches
from backends.torch_common.cpu_linear import route_cpu_linears
from backends.torch_common.dist_env import (
    device_id,
    device_info,
    empty_cache,
    init_torch_distributed,
    reset_peak_memory,
    resident_on,
)
from backends.torch_common.exact_generation import exact_generate
from backends.torch_common.exact_ops import apply_exact_numerics
from backends.torch_common.generation import GenerationReplica, hf_generate
from backends.torch_common.logprob_pass import TorchLogprobs
from backends.torch_common.lora import apply_lora, trainable_parameters
from backends.torch_common.memory_trade import full_copies_fit, weight_bytes
from backends.torch_common.model_loading import hf_param_meta, load_hf_model, torch_dtype
from backends.torch_common.moe import RouterRecorder
from backends.torch_common.optim import (
    build_optimizer,
    build_scheduler,
    current_lr,
    move_optimizer_state,
    set_adamw_params,
)
from backends.torch_common.precision import apply_matmul_precision, matmul_precision_state
from backends.torch_common.reference import ReferenceWeights, local_shards
from backends.torch_common.routing import TorchRouting
from backends.torch_common.sharding_hooks import TorchShardingHooks
from backends.torch_common.weights_io import TorchWeightsIO
from core.data import BatchedDataDict
from core.losses.contract import has_logprob_path
from core.losses.metrics import MicroBatchMetrics
from core.losses.router_aux import router_aux_for
from core.models.lora import is_adapter_name, lora_scale
from core.parallel_dims import ParallelDims
from core.policy.config import PolicyConfig
from core.policy.generation_args import GenerationArgs
from core.policy.optimizer_params import AdamWParams
from core.policy.preflight import check_tokenizer_fits
from core.policy.worker_base import OPTIMIZER_MISSING, REFERENCE_MISSING, PolicyWorkerBase, TrainCall, step_skip_reason
from core.refit.manifest import tied_aliases
from core.reporting import get_logger

if TYPE_CHECKING:
    from backends.torch_dtensor.context_parallel import ContextParallelRows
    from core.interfaces import LossFunction

logger = get_logger(__name__)


class TorchPolicyWorker(TorchLogprobs, TorchRouting, TorchWeightsIO, TorchShardingHooks, PolicyWorkerBase[TrainCall]):
    """One rank of a torch policy; constructed inside a Ray actor by ``core.policy.Policy``
    (arguments: ``PolicyWorkerBase``; ``weights_path`` / ``optimizer_path``: a DCP checkpoint)."""

    #: Sequence widths are padded to a multiple of this (sequence parallelism sets it to tp).
    _seq_multiple: int = 1
    #: Context-parallel row handling (the DTensor worker sets it when cp > 1).
    _cp_rows: ContextParallelRows | None = None

    def _build(self, resume: bool, init_optimizer: bool, init_reference_model: bool) -> None:
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
        check_tokenizer_fits(self.tokenizer, hf_model.config, self.cfg.model_name)
        self._exact = self.cfg.numerics == "exact"
        if self._exact:  # before any wrapping: FSDP / fully_shard wrap the exact layers
            apply_exact_numerics(hf_model)
        self.hf_config = hf_model.config
        # policy.lora: targeted linears become LoRALinear before any sharding; only adapters train.
        # A resumed run (weights_path) takes them from its checkpoint, not policy.lora.adapter_path.
        self.lora_modules = (
            apply_lora(hf_model, self.cfg.lora, self.rank, self.device, resume=resume) if self.cfg.lora.enabled else []
        )
        self.lora_scale = lora_scale(self.cfg.lora.alpha, self.cfg.lora.rank, self.cfg.lora.use_rslora)
        self.linear_path = route_cpu_linears(hf_model, self.device)  # fp32 CPU linears on oneDNN
        # Every stored weight, adapters included, in state-dict order (a base weight, then its
        # A and B); param_meta: the HF weights refit and export carry (merged).
        self._stored_meta = hf_param_meta(hf_model)
        self.param_meta = {n: m for n, m in self._stored_meta.items() if not is_adapter_name(n)}
        # Tied names (lm_head.weight of a tied model): in the state dict, not sent by refit.
        self._refit_skip = frozenset(tied_aliases(hf_model))
        self.hf_module = hf_model
        # A MoE model's training forward records its router logits for the load-balancing
        # loss (policy.moe).
        self.router_aux = router_aux_for(self.cfg.moe.router_aux_loss_coef, self.hf_config)
        self._routers = (
            RouterRecorder(hf_model, self.hf_config.model_type, bool(getattr(self.hf_config, "norm_topk_prob", False)))
            if self.router_aux
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
        self._replica = GenerationReplica(
            self.hf_config, self.device, self.compute_dtype, apply_exact_numerics if self._exact else None
        )

    # ------------------------------------------------------------------ what the layout is
    @classmethod
    def logits_loss_refusal(cls, cfg: PolicyConfig, context_parallel: int) -> str | None:
        """Packed rows and context-parallel rows never exist as a micro batch's full logits."""
        if cfg.sequence_packing.enabled or context_parallel > 1:
            return (
                "with sequence packing or context parallelism the worker never holds a micro batch's full "
                "[b, S, V] logits; use a core.losses loss"
            )
        return None

    @property
    def _data_parallel_size(self) -> int:
        return self.dims.dp

    @property
    def _context_parallel_size(self) -> int:
        return self.dims.cp

    @property
    def _has_optimizer(self) -> bool:
        return self.optimizer is not None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel process group (default: every rank is data parallel)."""
        world = dist.group.WORLD
        if world is None:  # init_torch_distributed ran in __init__
            raise RuntimeError("torch.distributed is not initialised")
        return world

    def _offload_params(self, flag: bool, field: str) -> bool:
        """Whether to apply parameter CPU offload: only meaningful with an accelerator (on a
        CPU device the parameters already live in host memory, and FSDP's offload paths
        require an accelerator), so on CPU the option is accepted and ignored, with a note."""
        if flag and self.device.type == "cpu":
            if self.rank == 0:
                logger.warning("%s=true has no effect on CPU workers: parameters are already in host memory", field)
            return False
        return flag

    # ------------------------------------------------------------------ weights
    def _local_weight_shards(self) -> list[torch.Tensor]:
        """The tensors storing this rank's part of the weights (swapped for the reference).

        Called right before the shards are overwritten, so it first drops any unsharded
        copy a wrapper kept from the last forward (FSDP keeps the root's parameters
        gathered after forward): the next forward must gather the new shards, not reuse
        stale full weights.
        """
        self._reshard_all()
        return local_shards(self.model)

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Within the block the model computes with the reference weights."""
        if self.reference is None:
            raise RuntimeError(REFERENCE_MISSING)
        with self.reference.swapped_in():
            yield

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

    # ------------------------------------------------------------------ training hooks
    @contextlib.contextmanager
    def _train_call(
        self, data: BatchedDataDict, loss_fn: LossFunction, local_gbs: int, mbs: int, eval_mode: bool
    ) -> Iterator[TrainCall]:
        self.model.train(not eval_mode)
        yield TrainCall(loss_fn, mbs, eval_mode, [data.get_batch(g, local_gbs) for g in range(data.size // local_gbs)])

    def _global_valid_counts(self, gb: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
        return global_valid_counts(gb, self.device, self.dp_group)

    def _run_micro_batches(
        self, call: TrainCall, gb: BatchedDataDict, gseq: torch.Tensor, gtok: torch.Tensor
    ) -> tuple[None, MicroBatchMetrics]:
        """Forward (and backward) of each micro batch; the gradients accumulate in the
        parameters, the metrics stay on the device.

        Gradients are reduced across ranks in the last micro batch's backward only (when
        the full-size unreduced gradients fit, ``memory_trade.full_copies_fit``): the others
        run under ``_no_gradient_sync`` (every rank has the same number of micro batches:
        fixed size, or a lockstep dynamic / packing plan).  An exception in here comes after
        collectives, so the group is torn down (``core.distributed.recoverable``): gradients
        held back by a failed loop never reach a later step.
        """
        if not call.eval_mode:
            self._require_optimizer().zero_grad(set_to_none=True)
        batches = list(micro_batches(gb, call.mbs))
        # Unreduced gradients are accumulated in fp32 (FSDP's reduce dtype), full size; with
        # them deferred, the gathered weights (compute dtype) are kept across micro batches
        # too when both fit: one all-gather per unit and call instead of two per micro batch.
        grads = weight_bytes(self.param_meta, torch.float32)
        defer = not call.eval_mode and full_copies_fit(self.device, len(batches), grads, self._offloading)
        keep = defer and full_copies_fit(
            self.device, len(batches), grads + weight_bytes(self.param_meta, self.compute_dtype), self._offloading
        )
        collected = MicroBatchMetrics()
        with self._keep_params_gathered_in_training() if keep else contextlib.nullcontext():
            for i, mb in enumerate(batches):
                deferred = defer and i < len(batches) - 1
                with (
                    torch.no_grad() if call.eval_mode else contextlib.nullcontext(),
                    self._no_gradient_sync() if deferred else contextlib.nullcontext(),
                    self._routing(mb, replay=self.cfg.moe.routing_replay.enabled),
                ):
                    loss, metrics = self._micro_batch_loss(mb, call.loss_fn, gseq, gtok)
                    if not call.eval_mode:
                        # FSDP averages gradients over the ranks it shards over (dp, and cp with
                        # context parallelism); the loss is already globally normalised (a sum over
                        # dp ranks; each cp rank holds a partial gradient of the same loss), so
                        # scale by that count to undo the average.
                        (loss * self.dims.dp * self.dims.cp).backward()
                collected.add(metrics)
        return None, collected

    def _micro_batch_loss(self, mb: BatchedDataDict, loss_fn: Any, gseq: torch.Tensor, gtok: torch.Tensor):
        """One micro batch's (loss, metrics); a MoE model's router terms join them
        (``core.losses.router_aux``: what ``_routing`` recorded of this forward)."""
        dev_mb = batch_to_device(mb, self.device)
        recorded = self._routers.active if self._routers is not None else None
        loss, metrics = self._loss_of(mb, dev_mb, loss_fn, gseq, gtok)
        if recorded is None or self.router_aux is None:
            return loss, metrics
        return self.router_aux.add_to(loss, metrics, self._router_logits_of(mb, recorded), dev_mb, gseq, gtok)

    def _loss_of(self, mb: BatchedDataDict, dev_mb: BatchedDataDict, loss_fn: Any, gseq, gtok):
        if has_logprob_path(loss_fn):
            # One logprob path for get_logprobs and train (same temperature, same
            # vocab-parallel kernel): the loss sees exactly what get_logprobs returns.
            return loss_fn.loss_from_logprobs(self._micro_batch_next_logprobs(mb), dev_mb, gseq, gtok)
        # Plain rows only: logits_loss_refusal refused packed and context-parallel rows.
        logits, ids, seq_len = self._forward_logits(mb)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return loss_fn(logits[:, :seq_len], dev_mb, gseq, gtok)

    def _device_scalar(self) -> torch.Tensor:
        return torch.zeros((), device=self.device)

    def _sum_over_dp(self, totals: torch.Tensor) -> torch.Tensor:
        """Each metric summed over the dp ranks, in one all-reduce (stays on the device)."""
        if self.dims.dp > 1 and totals.numel():
            dist.all_reduce(totals, group=self.dp_group)
        return totals

    def _queue_optimizer_step(
        self, grads: None, keys: list[str], totals: torch.Tensor, gseq: torch.Tensor, gtok: torch.Tensor
    ) -> list[torch.Tensor]:
        """The global gradient norm, read with the counts: torch decides on the host."""
        # The norm is measured (and the gradients clipped) before the decision; a skipped
        # step drops the gradients, so a non-finite norm's clipping poisons nothing.
        norm = self._clip_grad_norm(self.cfg.max_grad_norm)
        return [torch.stack([gseq, gtok, norm.float().to(self.device)])]

    def _finish_optimizer_step(self, read: list[list[float]], loss: float, gseq: Any, gtok: Any):
        """Apply the step, or skip it when ``step_skip_reason`` says so (the gradients are
        dropped: weights and optimizer state do not move); the values were all-reduced, so
        every rank decides alike."""
        ((seqs, toks, grad_norm),) = read
        reason = step_skip_reason(seqs, toks, loss, grad_norm)
        optimizer = self._require_optimizer()
        if reason is None:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        return grad_norm, reason

    def set_optimizer_params(self, params: AdamWParams) -> None:
        """AdamW's settings for the next steps (``Policy.set_optimizer_params``); state kept."""
        set_adamw_params(self._require_optimizer(), self.scheduler, params)
        self.cfg = self.cfg.model_copy(update={"max_grad_norm": params.max_grad_norm})

    def _require_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of a training call (``_check_train_call`` refused one without it)."""
        if self.optimizer is None:
            raise RuntimeError(OPTIMIZER_MISSING)
        return self.optimizer

    def _advance_schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
            self.train_step += 1

    def _learning_rate(self) -> float | None:
        return current_lr(self.optimizer) if self.optimizer is not None else None

    # ------------------------------------------------------------------ generation hook
    def _generate_rows(self, data: BatchedDataDict, args: GenerationArgs, greedy: bool) -> BatchedDataDict:
        """HF ``generate`` on an unsharded replica of the current weights."""
        # The weights are gathered into the replica first: a collective, on every rank.
        module = self._replica.load(self.iter_full_weights(self.compute_dtype))
        sample = exact_generate if self._exact else functools.partial(hf_generate, synced_gpus=False)
        out = sample(
            module,
            data.to(self.device),
            args.gen_cfg,
            greedy=greedy,
            tokenizer=self.tokenizer,
            **args.limits(),
            batch_size=self.cfg.generation_batch_size,
        )
        return out.to("cpu")

    # ------------------------------------------------------------------ placement hooks
    def _move_weights(self, on_device: bool) -> None:
        if on_device:
            self.move_to_device(self.model, self.device)
        else:
            self.move_to_cpu(self.model)

    def _set_training_mode(self, training: bool) -> None:
        self.model.train(training)

    def _move_optimizer_state(self, on_device: bool) -> None:
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device if on_device else "cpu")

    def _release_device_memory(self) -> None:
        empty_cache(self.device)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        """``model.to(device)`` unless nothing would move: the wrapper's parameter CPU offload
        owns placement, or every parameter and buffer is already there.  ``Module.to`` swaps
        every DTensor parameter even then (``swap_tensors``: new tensor objects at every
        ``prepare_for_*`` call, and an error while the profiler holds references to them)."""
        if self._offloading or resident_on(model, torch.device(device)):
            return model
        return model.to(device)

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.device.type != "cuda":
            raise RuntimeError("move_to_cuda: this worker has no CUDA device")
        return self.move_to_device(model, self.device)

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.move_to_device(model, "cpu")

    # ------------------------------------------------------------------ profiling and teardown hooks
    def _start_profiler(self, root: Path) -> tuple[torch.profiler.profile, Path]:
        """A torch.profiler trace (CPU activity, plus CUDA on GPU)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = profile(activities=activities, record_shapes=True)
        profiler.__enter__()
        return profiler, root

    def _stop_profiler(self, handle: tuple[torch.profiler.profile, Path]) -> str:
        """Chrome trace JSON, one file per rank."""
        profiler, root = handle
        profiler.__exit__(None, None, None)
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{type(self).__name__}_rank{self.rank}_{int(time.time())}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    def _leave_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
