"""``PolicyWorkerBase``: the skeleton every backend's policy worker shares, written once.

It implements the driver's contract (``core.policy.worker_protocol.PolicyWorker``) from small
mixins, one concern each, that call the engine's hooks:

* :mod:`core.policy.worker_training`   -- ``train`` and ``_train_global_batch`` (micro-batch
  loop, optimizer step, the step's one host read);
* :mod:`core.policy.worker_inference`  -- ``get_logprobs`` (with routed experts), the reference
  passes, ``generate``'s argument preparation;
* :mod:`core.policy.worker_offload`    -- the four placement states;
* :mod:`core.policy.worker_checkpoint` -- save / load, the HF export and its PEFT adapter;
* :mod:`core.policy.worker_refit`      -- the LoRA adapter refit stream (the weight stream
  itself is :class:`core.refit.sender.RefitSender`);
* :mod:`core.policy.worker_diagnostics` -- profiling and shutdown.

This module adds construction (the seeds' worker signature), the sampling temperature both
``get_logprobs`` and ``train`` apply, and the input checks a worker repeats for a caller that
went past the driver.  Each backend's worker class
supplies the hooks: forward and backward, the optimizer step, full-weight gathers, device
moves, its checkpoint format, its profiler.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from core.policy.checks import check_loss_fn, check_model_inputs, check_sequence_lengths, check_train_batch
from core.policy.config import PolicyConfig
from core.policy.worker_checkpoint import LORA_ADAPTER_DIR, WorkerCheckpoint
from core.policy.worker_diagnostics import WorkerDiagnostics
from core.policy.worker_inference import WorkerInference
from core.policy.worker_offload import WorkerOffload
from core.policy.worker_refit import WorkerAdapterRefit
from core.policy.worker_training import (
    CallT,
    StepResult,
    TrainCall,
    WorkerTraining,
    reports_worker_seconds,
    step_skip_reason,
)

if TYPE_CHECKING:
    from core.losses.router_aux import RouterAux

REFERENCE_MISSING = "this policy was built with init_reference_model=False: no reference weights"
OPTIMIZER_MISSING = "train() needs an optimizer: this policy was built with init_optimizer=False"

__all__ = [
    "LORA_ADAPTER_DIR",
    "OPTIMIZER_MISSING",
    "REFERENCE_MISSING",
    "PolicyWorkerBase",
    "StepResult",
    "TrainCall",
    "reports_worker_seconds",
    "step_skip_reason",
]


class PolicyWorkerBase(
    WorkerTraining[CallT],
    WorkerInference,
    WorkerOffload,
    WorkerCheckpoint,
    WorkerDiagnostics,
    WorkerAdapterRefit,
):
    """Base of every backend's policy worker; the refit methods come from
    ``RefitSender`` on top of each backend's ``iter_full_weights``."""

    rank: int = 0
    hf_config: Any  # the model's transformers config, set by the backend's constructor
    router_aux: RouterAux | None = None

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        tokenizer: Any = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **options: Any,
    ) -> None:
        """Args mirror NeMo RL's workers: ``config`` is the ``policy`` section, ``tokenizer`` an HF
        tokenizer; ``weights_path`` / ``optimizer_path`` resume from the backend's checkpoint
        (``options["checkpoint_verified"]``: the Policy verified its checksums on the driver)."""
        self.cfg = PolicyConfig.coerce(config, path="policy")
        self.tokenizer = tokenizer
        # The distribution generation samples from: applied identically by get_logprobs and train.
        self.temperature = self.cfg.generation.temperature if self.cfg.generation is not None else 1.0
        self.train_step = 0
        self._build(bool(weights_path), init_optimizer, init_reference_model)
        if weights_path:
            self.load_checkpoint(weights_path, optimizer_path, checksums=not options.get("checkpoint_verified", False))

    @abc.abstractmethod
    def _build(self, resume: bool, init_optimizer: bool, init_reference_model: bool) -> None:
        """Join the engine's runtime, load and shard the model, build the optimizer and keep
        the reference weights; ``resume``: a checkpoint follows (LoRA adapters come from it)."""

    def is_alive(self) -> bool:
        return True

    # ------------------------------------------------------------------ what the engine says of itself
    @classmethod
    @abc.abstractmethod
    def logits_loss_refusal(cls, cfg: PolicyConfig, context_parallel: int) -> str | None:
        """Why a loss without ``loss_from_logprobs`` cannot train with ``cfg``; None when it can."""

    @property
    @abc.abstractmethod
    def _data_parallel_size(self) -> int:
        """How many workers the driver's rows are sharded over (a global batch's divisor)."""

    @property
    def _data_parallel_devices(self) -> int:
        """Data-parallel ranks counted in devices, each running a batch size's rows per micro
        batch (the workers, where a worker is one device)."""
        return self._data_parallel_size

    def _micro_batch_rows(self, mbs: int) -> int:
        # this worker's share of a micro batch of ``mbs`` rows on every data-parallel device
        return mbs * self._data_parallel_devices // self._data_parallel_size

    @property
    def _context_parallel_size(self) -> int:
        """Ranks that split each sequence (1 without context parallelism)."""
        return 1

    @property
    @abc.abstractmethod
    def _has_optimizer(self) -> bool:
        """Whether this worker was built with an optimizer (``init_optimizer``)."""

    # ------------------------------------------------------------------ input checks
    # The driver's checks again, for a caller that went past it; callers run these inside
    # ``before_collectives()`` so that a failure here leaves the group usable.
    def _check_batch(self, data: Mapping[str, Any]) -> None:
        """``get_logprobs`` / ``generate`` input: lengths within the limit, ids and masks valid."""
        check_sequence_lengths(data, self.cfg.max_total_sequence_length)
        check_model_inputs(data, self.hf_config.vocab_size)

    def _check_train_call(
        self, data: Mapping[str, Any], loss_fn: Any, gbs: int, mbs: int, eval_mode: bool
    ) -> tuple[int, int]:
        """``train`` input, the loss's fit to this layout included; returns this rank's rows
        per global batch and per micro batch."""
        field = "policy.train_micro_batch_size" if mbs == self.cfg.train_micro_batch_size else "mbs"
        self._check_micro_batch_split(mbs, field)
        local_gbs = check_train_batch(
            data,
            gbs,
            mbs,
            self._data_parallel_devices,
            self.cfg.max_total_sequence_length,
            shards=self._data_parallel_size,
        )
        check_model_inputs(data, self.hf_config.vocab_size)
        contract = check_loss_fn(loss_fn)
        contract.refuse_logits_only(self.logits_loss_refusal(self.cfg, self._context_parallel_size))
        if not eval_mode and not self._has_optimizer:
            raise RuntimeError(OPTIMIZER_MISSING)
        return local_gbs, self._micro_batch_rows(mbs)
