"""``DTensorPolicyWorker``: the shared torch worker with FSDP2 (``fully_shard``) + TP/SP on a
(dp, cp, tp) device mesh.

Parallelism is applied in small ordered steps (torchtitan style): tensor parallel plan on
the ``tp`` sub-mesh, then FSDP2 per transformer block and at the root on the ``dp`` sub-mesh.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from core.parallel_dims import ParallelDims
from core.policy.preflight import check_tensor_parallel_fits

from backends.torch_common.grad_clip import clip_grad_norm_dtensor
from backends.torch_common.layers import decoder_layers
from backends.torch_common.optim import import_object
from backends.torch_common.model_loading import as_torch_dtype
from backends.torch_common.worker import TorchPolicyWorker
from backends.torch_dtensor.tp_plans import plan_for


# The global grad norm of parameters on the 2-D (dp, tp) mesh is reduced over both axes with
# two all-reduces of one scalar; DTensor logs a performance warning for it on every step.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class DTensorPolicyWorker(TorchPolicyWorker):
    """One rank of an FSDP2 (+ TP/SP) policy."""

    def _parallel_dims(self) -> ParallelDims:
        dims = ParallelDims.from_policy_config(self.cfg, self.world_size)
        if dims.cp > 1:
            # torch's context_parallel() shards SDPA ring attention over CUDA kernels only,
            # and HF models need position ids threaded through it; not supported here yet.
            raise NotImplementedError(
                f"policy.dtensor_cfg.context_parallel_size={dims.cp}: context parallelism is not "
                f"supported by the torch_dtensor backend on {self.device.type} in this version; set it to 1"
            )
        dtc = self.cfg["dtensor_cfg"]
        self.tp_size = dims.tp
        self.sequence_parallel = bool(dtc.get("sequence_parallel", False)) and dims.tp > 1
        self._seq_multiple = dims.tp if self.sequence_parallel else 1
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type, (dims.dp, dims.cp, dims.tp), mesh_dim_names=("dp", "cp", "tp")
        )
        return dims

    @property
    def _offloading(self) -> bool:
        return self._offload_params(bool(self.cfg["dtensor_cfg"].get("cpu_offload", False)), "policy.dtensor_cfg.cpu_offload")

    def _activation_checkpointing(self) -> bool:
        return bool(self.cfg["dtensor_cfg"].get("activation_checkpointing", False))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.tp_size > 1:
            self._apply_tp(model)
        self._apply_fsdp(model)
        return model

    def _apply_tp(self, model: torch.nn.Module) -> None:
        check_tensor_parallel_fits(model.config, self.tp_size, "policy.dtensor_cfg.tensor_parallel_size")
        custom = self.cfg["dtensor_cfg"].get("custom_parallel_plan")
        if isinstance(custom, str):
            custom = import_object(custom, "policy.dtensor_cfg.custom_parallel_plan")
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        parallelize_module(model, self.mesh["tp"], plan_for(model, self.sequence_parallel, custom))
        if tied:
            # Both styles shard the shared [V, H] weight as Shard(0), but each wraps it in its own
            # Parameter: re-tie so the embedding and the head keep one weight and one gradient.
            model.lm_head.weight = model.get_input_embeddings().weight

    def _apply_fsdp(self, model: torch.nn.Module) -> None:
        kwargs = dict(
            mesh=self.mesh["dp"],
            mp_policy=MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32),
        )
        if self._offloading:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        # The root holds embeddings, final norm and lm_head; keep it unsharded after forward
        # (its all-gather would be repeated immediately by backward).
        fully_shard(model, reshard_after_forward=False, **kwargs)

    def _reshard_all(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        return clip_grad_norm_dtensor(self.model.parameters(), max_norm)

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        # One parameter at a time: peak extra memory is one full tensor, not the model.
        state = self.model.state_dict()
        for name in self.param_meta:
            tensor = state[name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, tensor if dtype is None else tensor.to(as_torch_dtype(dtype))

    def move_to_device(self, model: torch.nn.Module, device) -> torch.nn.Module:
        if self._offloading:
            return model  # FSDP2's CPUOffloadPolicy owns parameter placement
        return model.to(device)
