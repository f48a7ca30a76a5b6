"""``Policy``: the driver-side facade of NeMo RL's ``lm_policy.Policy``, for every backend.

It owns a :class:`RayWorkerGroup` of the backend's workers (picked from
``config.backend`` through :mod:`core.policy.registry`), shards data over the
data-parallel axis, replicates it over ``cp``/``tp``, and returns results for the whole
batch in the caller's row order.  Nothing here imports torch model code or jax.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Union, overload

import torch

from core.checkpointing.policy_files import check_load_paths, check_save_paths, check_writable
from core.config import ConfigError, join_path
from core.data import BatchedDataDict, DynamicBatchingArgs
from core.data.sequence_packing import SequencePackingArgs, check_packing_budget
from core.distributed import RayVirtualCluster, RayWorkerGroup
from core.interfaces import (
    SKIP_REASONS,
    CallTiming,
    ColocatablePolicyInterface,
    GenerationInterface,
    NonFiniteStepError,
    RefittableGenerationInterface,
    TrainResult,
)
from core.losses.contract import check_loss_inputs
from core.losses.router_aux import check_routed_experts
from core.policy.checks import (
    check_loss_fn,
    check_model_inputs,
    check_one_step_for_fused_old_logprobs,
    check_prompt_room,
    check_sequence_lengths,
    check_train_batch,
)
from core.policy.config import PolicyConfig
from core.policy.generation_args import checked_row_limits
from core.policy.lora_adapter import check_lora_adapter
from core.policy.optimizer_params import AdamWParams, check_optimizer_params
from core.policy.preflight import absolute_model_paths, preflight_model_checks
from core.policy.registry import backend_spec
from core.policy.worker_dispatch import WorkerCalls, protocol_method_name
from core.policy.worker_protocol import PolicyWorker
from core.refit.cuda_ipc import merge_handles
from core.refit.manifest import RefitPart
from core.refit.shm import sweep_stale_segments

PathLike = Union[str, "os.PathLike[str]"]


class Policy(ColocatablePolicyInterface, GenerationInterface):
    """A trainable LM policy running on ``cluster`` with the backend ``config.backend``.

    Args mirror NeMo RL: ``config`` is the ``policy`` section (a :class:`PolicyConfig`, or the
    plain mapping of one, validated here with the world size of the group), ``tokenizer`` an
    HF tokenizer shipped to every worker,
    ``weights_path``/``optimizer_path`` a DCP checkpoint to resume from.
    """

    #: The engine the refit broadcast group was formed with (``core.refit.driver``; unset until then).
    _refit_peer: RefittableGenerationInterface
    _refit_token: str | None = None

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig | Mapping[str, Any],
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: int | list[int] | None = None,
        init_optimizer: bool = True,
        weights_path: PathLike | None = None,
        optimizer_path: PathLike | None = None,
        init_reference_model: bool = True,
    ) -> None:
        spec = backend_spec(PolicyConfig.coerce(config, path="policy").backend)
        n_workers = _world_size(cluster, workers_per_node)
        # A worker per device: the mesh must fit the worker count.  A worker that owns a whole
        # host: the spec's driver checks (below) count the devices it will see.
        cfg = PolicyConfig.checked(config, n_workers if spec.one_worker_per_device else None)
        self.cfg = absolute_model_paths(cfg)
        layout = spec.layout(self.cfg, n_workers)
        #: Data-parallel ranks the driver shards batches over (workers that get distinct rows).
        self.dp = layout.axis_size("dp")
        self.model_config = preflight_model_checks(self.cfg, tokenizer)
        if weights_path is None:  # a resumed run's adapters come from its checkpoint
            check_lora_adapter(self.cfg, self.model_config)
        if weights_path is not None or optimizer_path is not None:
            # Before any worker starts: a missing, partial, corrupt or mislabelled checkpoint is
            # a CheckpointError naming the path and file here, not a rank's failure killing the group.
            check_load_paths(
                weights_path,
                optimizer_path,
                fmt=spec.checkpoint_format,
                checksums=True,
                optimizer_required=spec.optimizer_files,
                restore=True,
            )
        # Last of the driver's checks: the spec's may ask the cluster (e.g. how many devices a
        # host worker will see), so the file checks above answer first.
        problems = spec.driver_checks(self.cfg, self.model_config, cluster, n_workers)
        if found := [f"{join_path('policy', field)}: {message}" for field, message in problems]:
            raise ConfigError(found)
        #: Data-parallel ranks counted in devices (``dp`` where a worker owns one device; on
        #: workers owning a host, its data-parallel devices times the workers): each runs
        #: ``train_micro_batch_size`` / ``logprob_batch_size`` rows per micro batch, as the
        #: config check says, so a batch size means the same work per device on every backend.
        self.data_parallel_size = spec.data_parallel_size(self.cfg, cluster, n_workers)
        self.tokenizer = tokenizer
        self.cluster = cluster
        #: The backend's worker class: the driver asks it what a layout refuses before sending work.
        self.worker_class: type[PolicyWorker] = spec.load_worker()
        #: Ranks that split each sequence (context parallelism); 1 without.
        self.context_parallel = layout.axis_size("cp") if layout.has_axis("cp") else 1
        self.worker_group = RayWorkerGroup(
            cluster,
            self.worker_class,
            self.cfg,
            tokenizer,
            name_prefix=name_prefix,
            workers_per_node=workers_per_node,
            layout=layout,
            weights_path=_absolute(weights_path),
            optimizer_path=_absolute(optimizer_path),
            checkpoint_verified=weights_path is not None,  # checksums done above: workers check sizes only
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
        )
        #: Typed calls on the workers: every one goes through a ``PolicyWorker`` method.
        self.workers = WorkerCalls(self.worker_group)
        # Surface construction errors (bad model path, OOM, a failed process group) now,
        # with the rank and cause, rather than at the first real call.
        self.workers.all(PolicyWorker.is_alive)

    # ------------------------------------------------------------------ helpers

    def _dynamic_args(self, budget_key: str) -> DynamicBatchingArgs | None:
        db = self.cfg.dynamic_batching
        if not db.enabled:
            return None
        if db.sequence_length_round is None:  # DynamicBatchingConfig.check: required when enabled
            raise ValueError("policy.dynamic_batching.sequence_length_round: required when enabled")
        return DynamicBatchingArgs(
            input_key="input_ids",
            input_lengths_key="input_lengths",
            sequence_length_round=db.sequence_length_round,
            # the budget is per data-parallel device: a worker owning several splits its
            # micro batch over them
            max_tokens_per_microbatch=getattr(db, budget_key) * (self.data_parallel_size // self.dp),
        )

    def _packing_args(self, budget_key: str, data: BatchedDataDict) -> SequencePackingArgs | None:
        """The packing plan's settings, after checking every sequence fits one packed row."""
        sp = self.cfg.sequence_packing
        if not sp.enabled:
            return None
        lengths = data["input_lengths"].tolist() if "input_lengths" in data else []
        budget = getattr(sp, budget_key)
        check_packing_budget(lengths, budget, f"policy.sequence_packing.{budget_key}")
        return SequencePackingArgs(
            input_key="input_ids",
            input_lengths_key="input_lengths",
            max_tokens_per_microbatch=budget,
            algorithm=sp.algorithm,
            shared_prompts=sp.shared_prompts,
        )

    def _shard(self, data: BatchedDataDict, batch_size: int | None, budget_key: str):
        """``(shards, order)``: ``order`` is None unless dynamic batching or packing sorted the rows."""
        dyn = self._dynamic_args(budget_key)
        packing = self._packing_args(budget_key, data)
        if dyn is None and packing is None:
            return data.shard_by_batch_size(self.dp, batch_size=batch_size), None
        return data.shard_by_batch_size(
            self.dp, batch_size=batch_size, dynamic_batching_args=dyn, sequence_packing_args=packing
        )

    def _inference_shards(self, data: BatchedDataDict) -> tuple[list[BatchedDataDict], Any, int]:
        """``data`` checked and sharded over dp for an inference call (padded to a multiple of
        dp): ``(shards, order, real rows)``; ``order`` as :meth:`_shard` returns it."""
        check_sequence_lengths(data, self.cfg.max_total_sequence_length)
        check_model_inputs(data, self.model_config.vocab_size)
        shards, order = self._shard(_pad_rows(data, self.dp), None, "logprob_mb_tokens")
        return shards, order, data.size

    @staticmethod
    def _merged(
        results: list[BatchedDataDict], order: Any, real: int, pad_values: Mapping[str, Any] | None = None
    ) -> BatchedDataDict:
        """The shards' results in the caller's order, without the padding rows."""
        merged: BatchedDataDict[Any] = BatchedDataDict.from_batches(results, pad_value_dict=dict(pad_values or {}))
        if order is not None:
            merged = merged.reorder_data(order)
        return merged.slice(0, real) if merged.size != real else merged

    # ------------------------------------------------------------------ PolicyInterface
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"logprobs": [B, S] float32}`` in the ``get_logprobs`` layout, in input order;
        ``micro_batch_size`` replaces ``policy.logprob_batch_size`` for this call (benchmarks)."""
        shards, order, real = self._inference_shards(data)
        results = self.workers.sharded(PolicyWorker.get_logprobs, shards, micro_batch_size=micro_batch_size)
        return self._merged(results, order, real)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``{"reference_logprobs": [B, S] float32}`` under the frozen reference weights."""
        shards, order, real = self._inference_shards(data)
        results = self.workers.sharded(
            PolicyWorker.get_reference_policy_logprobs, shards, micro_batch_size=micro_batch_size
        )
        return self._merged(results, order, real)

    def get_logprobs_and_reference(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``get_logprobs`` and ``get_reference_policy_logprobs`` in one call to the workers
        (one dispatch, one pass over the batch each): ``{"logprobs", "reference_logprobs"}``."""
        shards, order, real = self._inference_shards(data)
        results = self.workers.sharded(
            PolicyWorker.get_logprobs_and_reference, shards, micro_batch_size=micro_batch_size
        )
        return self._merged(results, order, real)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per ``gbs`` rows of ``data`` (``eval_mode``: loss only): a
        :class:`TrainResult` with the micro-batch metrics of every rank.  A step is skipped on
        every rank -- weights and optimizer state unchanged, the LR schedule not advanced by
        it -- when its global loss or grad norm is not finite or its
        global batch has no valid token; with ``policy.non_finite_step: error`` this then
        raises :class:`NonFiniteStepError` (the policy stays usable).
        """
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        start = time.perf_counter()
        contract = check_loss_fn(loss_fn)
        # A logits-only loss where the layout never holds full logits: refused here, by name,
        # before any worker call (inside a worker it would come after the step's collectives).
        contract.refuse_logits_only(self.worker_class.logits_loss_refusal(self.cfg, self.context_parallel))
        check_one_step_for_fused_old_logprobs(contract, data.size, gbs, eval_mode)
        check_train_batch(data, gbs, mbs, self.data_parallel_size, self.cfg.max_total_sequence_length, local=False)
        check_model_inputs(data, self.model_config.vocab_size)
        # Only on the driver (the workers trust it): a bad key or shape must not reach the
        # workers, where one rank's exception would take the whole group down, and the value
        # scan over the batch runs once, not once per rank.
        check_loss_inputs(loss_fn, data, self.model_config.vocab_size)
        check_routed_experts(data, self.cfg.moe.routing_replay.enabled, self.model_config)
        checked = time.perf_counter()
        shards, _ = self._shard(data, gbs, "train_mb_tokens")
        sharded = time.perf_counter()
        results = self.workers.sharded(
            PolicyWorker.train, shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        worker_s = max(r.worker_s for r in results)
        timing = CallTiming(checked - start, sharded - checked, time.perf_counter() - sharded, worker_s)
        out = replace(results[0].with_micro_batches_of(results), worker_s=worker_s, timing=timing)
        if not eval_mode and out.skipped_steps and self.cfg.non_finite_step == "error":
            raise NonFiniteStepError(_skip_message(out))
        return out

    def set_optimizer_params(self, params: AdamWParams) -> None:
        """The AdamW settings of the following ``train`` calls (until set again), replacing
        ``policy.optimizer.kwargs`` and ``policy.max_grad_norm``; the optimizer state (Adam's
        moments, the step count) is kept.  Needs ``policy.optimizer.name`` AdamW and no
        ``policy.scheduler`` (the caller owns the learning rate of every step)."""
        check_optimizer_params(self.cfg, params)
        self.workers.all(PolicyWorker.set_optimizer_params, params)

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.workers.all(PolicyWorker.prepare_for_training)

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        self.workers.all(PolicyWorker.prepare_for_lp_inference)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self.workers.all(PolicyWorker.finish_training)

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """DCP checkpoint: sharded weights (and optimizer + scheduler state); tokenizer files.

        Atomic: written to temporary siblings and renamed into place (replacing a previous
        checkpoint there only once the new one is complete) with a manifest of sizes and
        sha256 (``core.checkpointing.policy_files``).
        """
        check_save_paths({"weights_path": weights_path, "optimizer_path": optimizer_path})
        self.workers.all(
            PolicyWorker.save_checkpoint, _absolute(weights_path), _absolute(optimizer_path), _absolute(tokenizer_path)
        )

    def save_hf_checkpoint(self, path: str, save_tokenizer: bool = False) -> None:
        """An HF safetensors checkpoint of the current weights (loads with ``transformers``)."""
        check_writable(path, "save_hf_checkpoint: path")
        self.workers.all(PolicyWorker.save_hf_checkpoint, _absolute(path), save_tokenizer)

    def shutdown(self) -> bool:
        ok = self.worker_group.shutdown(cleanup_method=protocol_method_name(PolicyWorker.shutdown))
        sweep_stale_segments()  # refit segments of ranks that died without cleaning up
        return ok

    # ------------------------------------------------------------------ GenerationInterface (HF)
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """HF ``generate`` on the training workers: ``GenerationOutputSpec`` in input order."""
        gen = self.cfg.generation
        pad = gen.pad_token_id if gen is not None and gen.pad_token_id is not None else None
        pad = pad if pad is not None else getattr(self.tokenizer, "pad_token_id", None)
        pad_values = {"output_ids": 0 if pad is None else pad}
        check_prompt_room(data, self.cfg.max_total_sequence_length)
        if data.get("max_new_tokens") is not None:
            checked_row_limits(data["max_new_tokens"], data.size)
        shards, order, real = self._inference_shards(data)
        results = self.workers.sharded(PolicyWorker.generate, shards, greedy=greedy)
        return self._merged(results, order, real, pad_values)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        self.workers.all(PolicyWorker.prepare_for_lp_inference)
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True  # HF generation holds nothing beyond the training state

    # ------------------------------------------------------------------ colocation / refit
    def offload_before_refit(self) -> None:
        self.workers.all(PolicyWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        self.workers.all(PolicyWorker.offload_after_refit)

    def set_refit_part(self, part: RefitPart) -> None:
        """What the next refit streams (``core.refit.manifest.REFIT_PARTS``): every weight
        with LoRA merged (``full``), or for adapter-only refit the unmerged ``base`` / the
        ``adapter``.  The refit driver sets it before each stream."""
        self.workers.all(PolicyWorker.set_refit_part, part)

    @property
    def refit_token(self) -> str:
        """Names this policy to an engine that holds its base weights (adapter-only refit)."""
        if self._refit_token is None:
            import uuid

            self._refit_token = uuid.uuid4().hex
        return self._refit_token

    def prepare_refit_info(self) -> dict[str, Any]:
        """HF name -> (full shape, dtype name) of every tensor a refit carries, in the
        generation dtype (``generation.vllm_cfg.precision``, else ``precision``)."""
        return self.workers.all(PolicyWorker.refit_manifest)[0].to_info()

    def prepare_info_for_collective(self) -> dict[str, Any]:
        return self.prepare_refit_info()

    def prepare_weights_for_ipc(self, _refit_buffer_size_gb: float | None = None) -> list[list[str]]:
        """Start the weight stream on every worker; returns the bucket plan (HF names per bucket,
        each bucket at most ``refit_buffer_size_gb``; a larger tensor travels alone)."""
        return self.workers.all(PolicyWorker.prepare_weights_for_ipc, _refit_buffer_size_gb)[0]

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Gather the bucket ``keys`` (the next one of the plan) and export it: a shared-memory
        segment on CPU, CUDA IPC handles keyed by GPU UUID on GPU."""
        handles = [h for h in self.workers.all(PolicyWorker.get_weights_ipc_handles, keys) if h is not None]
        if handles[0].get("kind") == "cuda_ipc":
            return merge_handles(handles)
        return handles[0]

    def finish_refit_stream(self) -> None:
        """Release the last exported bucket (after the engine loaded it, or after a failure)."""
        self.workers.all(PolicyWorker.finish_refit_stream)

    def refit_rendezvous(self) -> tuple[str, int]:
        """Address and a free port on training rank 0's node for the broadcast group."""
        return self.cluster.get_master_address_and_port()

    def init_collective(self, ip: str, port: int, world_size: int) -> list:
        """Training rank 0 joins the weight-broadcast group as rank 0; returns the futures."""
        return self.workers.futures(PolicyWorker.init_collective, ip, port, world_size)

    def broadcast_weights_for_collective(self, _refit_buffer_size_gb: float | None = None) -> list:
        """Every rank gathers (collectives), rank 0 broadcasts; returns the futures."""
        return self.workers.futures(PolicyWorker.broadcast_weights_for_collective, _refit_buffer_size_gb)

    # ------------------------------------------------------------------ diagnostics
    def start_gpu_profiling(self) -> None:
        self.workers.all(PolicyWorker.start_gpu_profiling)

    def stop_gpu_profiling(self) -> list[str | None]:
        """Stop the traces; returns each rank's trace file."""
        return self.workers.all(PolicyWorker.stop_gpu_profiling)

    def get_gpu_info(self) -> list[dict[str, Any]]:
        return self.workers.all(PolicyWorker.get_gpu_info)

    def report_device_id(self) -> list[str]:
        return self.workers.all(PolicyWorker.report_device_id)

    def reset_peak_memory_stats(self) -> None:
        self.workers.all(PolicyWorker.reset_peak_memory_stats)


def describe_skipped_steps(result: TrainResult) -> list[str]:
    """One phrase per skipped optimizer step of a ``Policy.train`` result: which global
    batch of the call, why, and the loss / grad norm it had."""
    n = len(result.loss)
    out = []
    for i, reason in enumerate(result.skip_reasons):
        if reason is None:
            continue
        out.append(
            f"optimizer step {i + 1} of {n} of this train() call skipped: {SKIP_REASONS.get(reason, reason)} "
            f"(loss={result.loss[i]:.6g}, grad_norm={result.grad_norm[i]:.6g})"
        )
    return out


def _skip_message(result: TrainResult) -> str:
    return (
        "; ".join(describe_skipped_steps(result))
        + ". policy.non_finite_step is 'error': the weights and optimizer state are unchanged (the step was "
        "not applied on any rank) and the policy is still usable; set policy.non_finite_step: skip to skip "
        "such steps and continue, or lower policy.optimizer.kwargs.lr / check the rewards and advantages."
    )


@overload
def _absolute(path: PathLike) -> str: ...
@overload
def _absolute(path: None) -> None: ...
@overload
def _absolute(path: PathLike | None) -> str | None: ...
def _absolute(path: PathLike | None) -> str | None:
    """Paths the workers use, resolved on the driver: workers run in their own directory."""
    return None if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))


def _world_size(cluster: RayVirtualCluster, workers_per_node: int | list[int] | None) -> int:
    counts = cluster.bundle_ct_per_node_list
    if workers_per_node is None:
        return sum(counts)
    if isinstance(workers_per_node, int):
        return workers_per_node * len(counts)
    return sum(workers_per_node)


def _pad_rows(data: BatchedDataDict, multiple: int) -> BatchedDataDict:
    """Append copies of the last row (with ``sample_mask`` 0 if present) so the row count is a
    multiple of ``multiple``: every data-parallel rank then runs the same number of forward
    passes, which FSDP's collectives require."""
    extra = (-data.size) % multiple
    if extra == 0 or data.size == 0:
        return data
    filler = data.select_indices([data.size - 1] * extra)
    if "sample_mask" in filler:
        filler["sample_mask"] = torch.zeros_like(filler["sample_mask"])
    return BatchedDataDict.from_batches([data, filler])
