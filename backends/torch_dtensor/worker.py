"""``DTensorPolicyWorker``: the shared torch worker with FSDP2 (``fully_shard``) + TP/SP on a
(dp, cp, tp) device mesh.

Parallelism is applied in small ordered steps (torchtitan style): vocabulary padding (when
tp does not divide it; ``vocab_padding.py``), tensor parallel plan on the ``tp`` sub-mesh,
activation checkpointing, ``torch.compile`` per transformer block (``compile.py``), then
FSDP2 per transformer block and at the root on the ``dp`` sub-mesh.

Per micro batch FSDP2 does no avoidable work: gradients are reduce-scattered in the last
micro batch's backward only (``set_requires_gradient_sync``), and a get_logprobs call
gathers each block once (``set_reshard_after_forward``), see ``TorchPolicyWorker``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from backends.torch_common.grad_clip import clip_grad_norm_dtensor
from backends.torch_common.layers import decoder_layers
from backends.torch_common.lora import freeze_all_but_adapters
from backends.torch_common.model_loading import as_torch_dtype
from backends.torch_common.optim import import_object
from backends.torch_common.torch_private import REDISTRIBUTE_LOGGER, flatten_mesh
from backends.torch_common.worker import TorchPolicyWorker
from backends.torch_dtensor.compile import compile_blocks
from backends.torch_dtensor.context_parallel import (
    ContextParallelRows,
    create_context_parallel_ctx,
    install_allgather_attention,
    train_context,
)
from backends.torch_dtensor.spec import settings as dtensor_settings
from backends.torch_dtensor.tp_plans import plan_for, with_lora
from backends.torch_dtensor.vocab_padding import OriginalVocabLoss, pad_vocab_, padded_vocab_size, unpad_rows
from core.losses.contract import has_logprob_path
from core.parallel_dims import ParallelDims
from core.policy.preflight import check_tensor_parallel_fits

# The global grad norm of parameters on the 2-D (dp, tp) mesh is reduced over both axes with
# two all-reduces of one scalar; DTensor logs a performance warning for it on every step.
logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _FullyShardKwargs(TypedDict, total=False):
    """What ``_apply_fsdp`` passes to every ``fully_shard`` call besides the module."""

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


class DTensorPolicyWorker(TorchPolicyWorker):
    """One rank of an FSDP2 (+ TP/SP) policy."""

    def _parallel_dims(self) -> ParallelDims:
        dims = self.cfg.parallel_dims(self.world_size)
        self.tp_size = dims.tp
        self.sequence_parallel = bool(self.cfg.parallel.sequence_parallel) and dims.tp > 1
        # Sequence parallelism splits a rank's columns over tp; context parallelism splits
        # the row into 2 x cp load-balanced chunks.
        self._seq_multiple = (dims.tp if self.sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type, (dims.dp, dims.cp, dims.tp), mesh_dim_names=("dp", "cp", "tp")
        )
        # FSDP2 shards over dp x cp: its gradient reduction then also sums the cp ranks'
        # partial gradients (each computed from its own share of the sequence).
        self.fsdp_mesh = flatten_mesh(self.mesh["dp", "cp"], "dp_cp") if dims.cp > 1 else self.mesh["dp"]
        self._cp_rows = ContextParallelRows(self.mesh["cp"].get_group()) if dims.cp > 1 else None
        return dims

    # The seed's context-parallel API (torch ring attention; see context_parallel.py).
    create_context_parallel_ctx = staticmethod(create_context_parallel_ctx)
    train_context = staticmethod(train_context)

    @property
    def _offloading(self) -> bool:
        return self._offload_params(bool(self.cfg.cpu_offload), "policy.cpu_offload")

    def _activation_checkpointing(self) -> bool:
        return bool(self.cfg.activation_checkpointing)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def _compile(self) -> bool:
        return bool(self.cfg.compile)

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):  # load_hf_model's: an HF causal LM
            raise TypeError(f"DTensorPolicyWorker parallelizes HF models, got {type(model).__name__}")
        self._pad_vocabulary(model)
        if self._cp_rows is not None:
            install_allgather_attention(model, self._cp_rows.group)
        if self.tp_size > 1:
            self._apply_tp(model)
        # Activation checkpointing was switched on by the base class (HF's per-block flag)
        # before this method: TP -> AC -> compile -> FSDP, torchtitan's order.
        if self._compile:
            compile_blocks(model)
        self._apply_fsdp(model)
        return model

    def _pad_vocabulary(self, model: PreTrainedModel) -> None:
        """Zero-pad embedding and lm_head rows to a multiple of tp (and of
        ``policy.make_vocab_size_divisible_by``); the padded logits are masked
        (``backends/torch_dtensor/vocab_padding.py``)."""
        vocab = int(model.config.vocab_size)
        multiple = int(self.cfg.make_vocab_size_divisible_by or 1)
        self.padded_vocab_size = padded_vocab_size(vocab, self.tp_size, multiple)
        pad_vocab_(model, self.padded_vocab_size)

    def _micro_batch_loss(self, mb, loss_fn, gseq, gtok):
        if self.padded_vocab_size != self.hf_config.vocab_size and not has_logprob_path(loss_fn):
            loss_fn = OriginalVocabLoss(loss_fn, self.hf_config.vocab_size)  # full logits: [..., :V]
        return super()._micro_batch_loss(mb, loss_fn, gseq, gtok)

    def _apply_tp(self, model: PreTrainedModel) -> None:
        check_tensor_parallel_fits(model.config, self.tp_size, "policy.parallel.tensor_parallel_size")
        custom = dtensor_settings(self.cfg).custom_parallel_plan
        if isinstance(custom, str):
            custom = import_object(custom, "policy.dtensor_cfg.custom_parallel_plan")
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        plan = plan_for(model, self.sequence_parallel, custom)
        if self.lora_modules:
            plan = with_lora(plan, self.lora_modules)
        parallelize_module(model, self.mesh["tp"], plan)
        if self.lora_modules:
            freeze_all_but_adapters(model)  # SequenceParallel re-creates the norm weights trainable
        if tied:
            # Both styles shard the shared [V, H] weight as Shard(0), but each wraps it in its own
            # Parameter: re-tie so the embedding and the head keep one weight and one gradient.
            model.lm_head.weight = model.get_input_embeddings().weight

    def _apply_fsdp(self, model: torch.nn.Module) -> None:
        kwargs = _FullyShardKwargs(
            mesh=self.fsdp_mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32),
        )
        if self._offloading:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        self._fsdp_blocks = decoder_layers(model)
        for layer in self._fsdp_blocks:
            fully_shard(layer, reshard_after_forward=True, **kwargs)
        # The root holds embeddings, final norm and lm_head; keep it unsharded after forward
        # (its all-gather would be repeated immediately by backward).
        fully_shard(model, reshard_after_forward=False, **kwargs)

    @contextlib.contextmanager
    def _no_gradient_sync(self):
        # FSDP2 then accumulates unsharded gradients in the reduce dtype (fp32), so deferring
        # the reduce-scatter changes no precision; the next synced backward reduces the sum.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def _keep_params_gathered(self):
        for block in self._fsdp_blocks:
            block.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for block in self._fsdp_blocks:
                block.set_reshard_after_forward(True, recurse=False)
                block.reshard()

    @contextlib.contextmanager
    def _keep_params_gathered_in_training(self):
        # FSDP2's gradient-accumulation trade: no reshard after forward (backward reuses the
        # gathered blocks) nor after backward (the next micro batch's forward does too).
        self.model.set_reshard_after_backward(False)
        try:
            with self._keep_params_gathered():
                yield
        finally:
            self.model.set_reshard_after_backward(True)
            self._reshard_all()

    def _reshard_all(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_dtensor(self.model.parameters(), max_norm)

    def _iter_stored_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # One parameter at a time: peak extra memory is one full tensor, not the model.
        # ``skip``: names not gathered at all (every rank passes the same set).
        state = self.model.state_dict()
        for name in (n for n in self._stored_meta if n not in skip):
            tensor = state[name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            tensor = unpad_rows(tensor, self._stored_meta[name][0])  # padded vocab rows never leave
            yield name, tensor if dtype is None else tensor.to(as_torch_dtype(dtype))


if TYPE_CHECKING:  # the type checker holds this worker to the driver's contract
    from core.policy.worker_protocol import PolicyWorker

    _contract: type[PolicyWorker] = DTensorPolicyWorker
