"""A training client's model: one ``Policy`` and the state the Tinker API keeps around it.

``forward_backward`` computes the loss and each datum's logprobs with ``get_logprobs`` and
keeps the datums; ``optim_step`` then trains on every datum kept since the last step in one
``Policy.train`` call (one optimizer step, the Tinker losses summed: ``TinkerLoss``) with the
step's AdamW settings.  The weights change only at ``optim_step``, so the gradient taken
there is the one ``forward_backward`` would have taken -- the sum over its calls, as the
Tinker API accumulates them -- at the cost of a second forward over the batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from core.data import BatchedDataDict
from core.losses.tinker_losses import TinkerLoss
from core.policy.config import LORA_TARGETS, PolicyConfig
from core.policy.optimizer_params import AdamWParams
from core.tinker_api.datums import ForwardBackwardRequest
from core.tinker_api.wire import forward_backward_output

#: LoRA targets of the Tinker LoRA config's switches (PEFT names of a Llama-style decoder).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
#: The file beside a saved state that says what model it holds.
STATE_FILE = "tinker_state.json"


@dataclass(frozen=True)
class ModelSpec:
    """What a create request (or a saved state) fixes for a model's whole life."""

    lora_rank: int | None
    """None: full fine-tuning."""
    lora_targets: tuple[str, ...] = ()
    lora_seed: int = 0

    def policy_config(self, base: PolicyConfig) -> PolicyConfig:
        """The server's policy section with this model's LoRA."""
        cfg = base.model_copy(deep=True)
        if self.lora_rank is not None:
            cfg.lora.enabled = True
            cfg.lora.rank = self.lora_rank
            cfg.lora.target_modules = [t for t in LORA_TARGETS if t in self.lora_targets]
            cfg.lora.init_seed = self.lora_seed
        return cfg

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ModelSpec:
        return cls(raw["lora_rank"], tuple(raw["lora_targets"]), int(raw["lora_seed"]))


class ServedModel:
    """The policy of one model and the datums waiting for its next ``optim_step``."""

    def __init__(self, model_id: str, spec: ModelSpec, policy: Any, step: int = 0):
        self.model_id = model_id
        self.spec = spec
        self.policy = policy
        self.step = step
        """Optimizer steps applied (the weights' version: a sampler samples the version it saved)."""
        self.pending: list[BatchedDataDict] = []
        self.params: AdamWParams | None = None
        self.loss = TinkerLoss()

    def forward(self, request: ForwardBackwardRequest) -> bytes:
        """The ``ForwardBackwardOutput`` (protobuf) of a forward or forward_backward request:
        per datum its targets' ``logprobs`` and ``elementwise_loss``, and ``loss:sum``."""
        rows = request.rows
        logprobs = self.policy.get_logprobs(rows)["logprobs"].float()
        elementwise = self.loss.elementwise(logprobs[:, 1:], rows)
        outputs = [
            {"logprobs": logprobs[i, 1 : n + 1].numpy(), "elementwise_loss": elementwise[i, :n].numpy()}
            for i, n in enumerate(request.target_counts)
        ]
        if not request.forward_only:
            self.pending.append(rows)
        return forward_backward_output(outputs, {"loss:sum": float(elementwise.sum())})

    def optim_step(self, params: AdamWParams) -> dict[str, Any]:
        """One optimizer step on every datum kept since the last one; ``OptimStepResponse``."""
        if params != self.params:
            self.policy.set_optimizer_params(params)
            self.params = params
        batch: BatchedDataDict[Any] = BatchedDataDict.from_batches(self.pending)
        datums = batch.size
        batch, mbs = padded_train_batch(batch, self.policy.data_parallel_size, self.policy.cfg.train_micro_batch_size)
        result = self.policy.train(batch, self.loss, gbs=batch.size, mbs=mbs)
        self.pending = []
        skipped = result.skipped_steps > 0
        if not skipped:
            self.step += 1
        return {
            "metrics": {
                "loss:sum": float(result.loss[0]),
                "grad_norm:mean": float(result.grad_norm[0]),
                "lr:mean": float(params.lr),
                "num_datums:sum": float(datums),
                "skipped:sum": float(skipped),
            }
        }

    def save_state(self, directory: Path, base_model: str, user_metadata: dict[str, Any]) -> None:
        """A checkpoint ``from_saved_state`` loads: weights, optimizer state, what model it is."""
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_checkpoint(str(directory / "weights"), str(directory / "optimizer"))
        state = {
            "base_model": base_model,
            "backend": self.policy.cfg.backend,
            "step": self.step,
            "spec": asdict(self.spec),
            "adam": None if self.params is None else asdict(self.params),
            "user_metadata": user_metadata,
        }
        (directory / STATE_FILE).write_text(json.dumps(state, indent=1))

    def save_for_sampler(self, directory: Path) -> None:
        """HF safetensors of the current weights (LoRA merged, the PEFT adapter beside them)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_hf_checkpoint(str(directory), save_tokenizer=True)

    def shutdown(self) -> None:
        self.policy.shutdown()


def read_saved_state(directory: Path) -> dict[str, Any]:
    """The ``STATE_FILE`` of a saved state (``FileNotFoundError`` / ``ValueError`` otherwise)."""
    return json.loads((directory / STATE_FILE).read_text())


def saved_adam_params(state: dict[str, Any]) -> AdamWParams | None:
    """The AdamW settings a state was saved with (its optimizer state belongs to them)."""
    adam = state.get("adam")
    if adam is None:
        return None
    return AdamWParams(adam["lr"], tuple(adam["betas"]), adam["eps"], adam["weight_decay"], adam["max_grad_norm"])


def padded_train_batch(batch: BatchedDataDict, dp: int, max_mbs: int) -> tuple[BatchedDataDict, int]:
    """``(batch, mbs)`` for one optimizer step on all of ``batch``: rows (copies of the last,
    ``sample_mask`` 0, adding nothing to the sum) appended up to a multiple of ``dp x mbs``,
    with ``mbs`` the smallest micro batch that needs no more micro batches per rank than
    ``max_mbs`` (policy.train_micro_batch_size) would."""
    per_rank = math.ceil(batch.size / dp)
    micro_batches = math.ceil(per_rank / max_mbs)
    mbs = math.ceil(per_rank / micro_batches)
    extra = dp * mbs * micro_batches - batch.size
    if extra == 0:
        return batch, mbs
    filler = batch.select_indices([batch.size - 1] * extra)
    filler["sample_mask"] = torch.zeros_like(filler["sample_mask"])
    return BatchedDataDict.from_batches([batch, filler]), mbs


def adam_params_of(request_params: Any) -> AdamWParams:
    """The SDK's ``AdamParams`` as AdamW settings (``grad_clip_norm`` 0: no clipping)."""
    clip = float(request_params.grad_clip_norm)
    return AdamWParams(
        lr=float(request_params.learning_rate),
        betas=(float(request_params.beta1), float(request_params.beta2)),
        eps=float(request_params.eps),
        weight_decay=float(request_params.weight_decay),
        max_grad_norm=None if clip <= 0 else clip,
    )
