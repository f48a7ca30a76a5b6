"""``PolicyWorker``: the driver -> worker contract, written once.

Every method the :class:`core.policy.Policy` facade calls on its Ray workers is listed here,
with its arguments, its result and what it promises; ``Policy`` dispatches only through these
methods (:mod:`core.policy.worker_dispatch`), never by a free-form method name, so the type
checker sees a misspelt method or a mistyped argument.  Each backend checks its worker classes
against this protocol (an ``if TYPE_CHECKING:`` assignment next to each concrete class).

Conventions every method keeps (see :mod:`core.interfaces`): data crosses as
``BatchedDataDict``s of host torch tensors; a method whose name says "collective" must be
called on every worker of the group at once (the driver does); input checks run inside
``core.distributed.before_collectives`` so a refused call leaves the group usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from core.data import BatchedDataDict
    from core.interfaces import LossFunction, TrainResult
    from core.policy.config import PolicyConfig
    from core.policy.optimizer_params import AdamWParams
    from core.refit.manifest import RefitManifest, RefitPart


class PolicyWorker(Protocol):
    """One rank (torch) or host (JAX) of a policy, as the driver sees it."""

    # ------------------------------------------------------------------ before any worker starts
    @classmethod
    def logits_loss_refusal(cls, cfg: PolicyConfig, context_parallel: int) -> str | None:
        """Why a loss without ``loss_from_logprobs`` (a logits-only loss) cannot train on this
        backend with ``cfg`` and ``context_parallel`` ranks per sequence; None when it can.
        Called on the driver, before the train call is sent, so the refusal costs no worker."""
        ...

    def is_alive(self) -> bool:
        """True once the constructor finished (model loaded, sharded, optimizer built)."""
        ...

    # ------------------------------------------------------------------ inference
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """This worker's shard scored without gradients: ``{"logprobs": [B, S] float32}`` in
        the ``get_logprobs`` layout (plus ``routed_experts`` [B, S, layers, top_k] when a
        mixture-of-experts policy records its routing), rows in input order.
        ``micro_batch_size`` replaces ``policy.logprob_batch_size`` for this call."""
        ...

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``get_logprobs`` under the frozen reference weights: ``{"reference_logprobs"}``;
        the trainable weights are the same afterwards."""
        ...

    def get_logprobs_and_reference(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """Both passes in one call: ``{"logprobs", "reference_logprobs"}``."""
        ...

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Continue this worker's prompts with the current weights (``policy.generation``):
        a ``GenerationOutputSpec`` on the host, rows in input order.  Collective."""
        ...

    # ------------------------------------------------------------------ training
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per global batch of this worker's shard (``gbs`` rows over all
        ranks, ``mbs`` per micro batch); the loss normalised by the global batch's counts.
        A step with no valid token or a non-finite global loss / gradient norm is skipped on
        every rank alike.  ``eval_mode``: the loss and metrics only.  The result's values are
        the same on every rank except ``all_mb_metrics`` (this worker's micro batches).
        Collective."""
        ...

    def set_optimizer_params(self, params: AdamWParams) -> None:
        """AdamW's settings for the next ``train`` calls (``Policy.set_optimizer_params``,
        checked there): learning rate, betas, eps, decoupled weight decay, gradient clipping;
        the optimizer state (moments, step counts) is kept."""
        ...

    def prepare_for_training(self) -> None:
        """Weights and optimizer state on the device, the model in training mode."""
        ...

    def prepare_for_lp_inference(self) -> None:
        """Weights on the device, optimizer state in host memory, the model in eval mode."""
        ...

    def finish_training(self) -> None:
        """The end of a training phase (the state stays resident until offloaded)."""
        ...

    # ------------------------------------------------------------------ colocation
    def offload_before_refit(self) -> None:
        """Optimizer state to host memory before the weights are streamed out."""
        ...

    def offload_after_refit(self) -> None:
        """Weights and optimizer state to host memory: the generation engine owns the device."""
        ...

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """The backend's sharded checkpoint (weights; optimizer, schedule and step with
        ``optimizer_path``; tokenizer files with ``tokenizer_path``), written atomically with a
        manifest.  Collective."""
        ...

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None, checksums: bool = True) -> None:
        """Restore what ``save_checkpoint`` wrote, after checking manifest, kinds, keys and
        shapes (``CheckpointError`` naming the cause); ``checksums``: verify the sha256 too.
        Collective."""
        ...

    def save_hf_checkpoint(self, path: str, save_tokenizer: bool = False) -> None:
        """An HF safetensors checkpoint of the current weights (LoRA merged, the PEFT adapter
        beside them in ``lora_adapter/``), written by rank 0.  Collective."""
        ...

    # ------------------------------------------------------------------ refit (weights -> engine)
    def set_refit_part(self, part: RefitPart) -> None:
        """What the next refit streams: ``full``, or for adapter-only refit ``base`` / ``adapter``."""
        ...

    def refit_manifest(self) -> RefitManifest:
        """Name -> (shape, dtype) of the coming stream, in the generation dtype."""
        ...

    def prepare_weights_for_ipc(self, refit_buffer_size_gb: float | None = None) -> list[list[str]]:
        """Start the weight stream; returns the bucket plan (HF names per bucket)."""
        ...

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any] | None:
        """Gather the next bucket (collective) and export it: a shared-memory segment from
        rank 0 on CPU, CUDA IPC handles from every rank on GPU; None from a rank that ships nothing."""
        ...

    def finish_refit_stream(self) -> None:
        """Release the last exported bucket and close the stream (also after a failure)."""
        ...

    def init_collective(self, ip: str, port: int, world_size: int, timeout_s: float = ...) -> int | None:
        """Training rank 0 joins the weight-broadcast group at ``ip:port`` as its rank 0
        (returns 0); the other ranks do not join (return None)."""
        ...

    def broadcast_weights_for_collective(self, refit_buffer_size_gb: float | None = None) -> int:
        """Stream every weight; rank 0 broadcasts each bucket to the engine.  Collective."""
        ...

    # ------------------------------------------------------------------ diagnostics and teardown
    def start_gpu_profiling(self) -> None:
        """Start the engine's profiler trace on this worker."""
        ...

    def stop_gpu_profiling(self) -> str | None:
        """Stop the trace and write it under ``$DUALRL_PROFILE_DIR``; returns its path (None
        when no trace was running)."""
        ...

    def get_gpu_info(self) -> dict[str, Any]:
        """Device facts of this worker (type, memory, the matmul precision it applied)."""
        ...

    def report_device_id(self) -> str:
        """A string naming this worker's device (platform, host, process, device index)."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Reset the device's peak-memory counter where the engine has one."""
        ...

    def shutdown(self) -> bool:
        """Release the refit stream and leave the process group; True on success.  The group
        calls it on every worker at once before killing the actors."""
        ...
