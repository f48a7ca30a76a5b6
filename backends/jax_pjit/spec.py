"""The ``jax_pjit`` backend's spec: ``jax.jit`` over a named (fsdp, cp, tp) mesh, one worker per
host owning all of its devices, orbax checkpoints, and its own block ``policy.jax_cfg``.

Imports only core and pydantic, never jax: the driver validates a config without it.
Registered by the ``dualrl.backends`` entry point in pyproject.toml.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from backends.jax_pjit.widths import check_cp_ladders
from core.config import ConfigModel, Problem
from core.policy.backend_spec import BackendSpec

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from core.distributed import RayVirtualCluster
    from core.policy.config import PolicyConfig

#: The torch optimizers / schedulers the backend reproduces with optax (``optim.SUPPORTED_*``,
#: which a test holds equal to these: the driver checks names without importing optax).
OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD")
SCHEDULERS = ("torch.optim.lr_scheduler.LinearLR", "torch.optim.lr_scheduler.ConstantLR")

#: Why ``parallel.expert_parallel_size`` must equal the fsdp size (the static and the layout check).
EXPERT_AXIS = (
    "{ep} must be 1 or the fsdp size ({fsdp}): the JAX backend stores the experts over the fsdp "
    "axis and runs them expert-parallel over that axis"
)


class JaxConfig(ConfigModel):
    """Settings only the ``jax_pjit`` backend has (``policy.jax_cfg``)."""

    moe_dispatch: Literal["auto", "dense", "blocked", "grouped"] = "auto"
    """How a mixture of experts' sparse layers run their experts (docs/moe.md): "dense" (every
    expert on every token, weight 0 for the others: num_experts / top_k times the work),
    "blocked" (each token through its top-k experts, in expert-sorted blocks, where that is
    faster than dense on the platform: on CPU; on an H100 from ~8K tokens of a
    Qwen3-30B-A3B layer), "grouped" (jax.lax.ragged_dot: for accelerators with a grouped kernel;
    on CPU and GPU a reference expansion, slower than dense); "auto": blocked on CPU and GPU (both
    measured), dense on TPU.  A value other than auto on a dense model is refused."""

    padded_widths_per_doubling: Literal[1, 2, 4, 8] = 2
    """The widths a micro batch's rows are padded to, per doubling of the sequence length, from
    16 up to ``policy.max_total_sequence_length`` (or a packing budget): ``jax.jit`` compiles one
    program per width and step kind, so this trades padding for programs.  1: powers of two
    (16, 32, 64, ...: a row of 17 tokens computes 32 columns); 2: the midpoints too (16, 24,
    32, 48, ...: at most 1.5x the longest row); 4 and 8 finer still.  The torch backends pad a
    micro batch to its longest row."""


def settings(policy: PolicyConfig) -> JaxConfig:
    """``policy.jax_cfg`` (its defaults where the config has no such block)."""
    return policy.block(SPEC, JaxConfig)


def _checks(policy: PolicyConfig) -> Iterable[Problem]:
    ep, fsdp = policy.parallel.expert_parallel_size, policy.parallel.fsdp_size
    if ep > 1 and fsdp not in (-1, ep):
        yield "parallel.expert_parallel_size", EXPERT_AXIS.format(ep=ep, fsdp=fsdp)


def _layout_checks(policy: PolicyConfig, world_size: int) -> Iterable[Problem]:
    dims = policy.parallel_dims(world_size)
    ep, fsdp = policy.parallel.expert_parallel_size, dims.fsdp
    if ep > 1 and ep != fsdp:
        yield "parallel.expert_parallel_size", EXPERT_AXIS.format(ep=ep, fsdp=fsdp)
    try:  # every width a step can see must split into the cp chunks (RowLayouts checks it again)
        check_cp_ladders(policy, dims.cp, settings(policy).padded_widths_per_doubling)
    except ValueError as err:
        yield "make_sequence_length_divisible_by", str(err)


def _model_checks(policy: PolicyConfig, model_config: PreTrainedConfig) -> Iterable[Problem]:
    from core.losses.router_aux import moe_top_k

    dispatch = settings(policy).moe_dispatch
    if dispatch != "auto" and moe_top_k(model_config) is None:
        yield (
            "jax_cfg.moe_dispatch",
            f"{dispatch}: model_type {getattr(model_config, 'model_type', None)!r} has no mixture-of-experts router "
            "(num_experts_per_tok)",
        )


def _driver_checks(
    policy: PolicyConfig, model_config: PreTrainedConfig, cluster: RayVirtualCluster, workers: int
) -> Iterable[Problem]:
    # jax is imported here, when a JAX policy is about to start, never to validate a config.
    from backends.jax_pjit.driver_checks import policy_problems

    return policy_problems(policy, model_config, cluster, workers)


def _devices_per_worker(cluster: RayVirtualCluster) -> int:
    from backends.jax_pjit.driver_checks import host_device_count

    return host_device_count(cluster)


SPEC = BackendSpec(
    name="jax_pjit",
    worker="backends.jax_pjit.worker:JaxPolicyWorker",
    layout_prefix="jax",
    data_axis="fsdp",
    supports=frozenset(
        {
            "parallel.tensor_parallel_size",
            "parallel.context_parallel_size",
            "parallel.expert_parallel_size",
            "activation_checkpointing",
            "make_vocab_size_divisible_by",
            "sequence_packing.enabled",
            "sequence_packing.shared_prompts",
            "dynamic_batching.enabled",
            "lora.enabled",
            "generation.backend",
            "numerics",
        }
    ),
    why_not={
        "parallel.sequence_parallel": "the JAX mesh has no sequence-parallel sharding of the tp group's norms",
        "cpu_offload": "the JAX backend keeps parameters and optimizer state on the devices",
        "compile": "its steps are always compiled by jax.jit; policy.compile switches torch.compile",
        "lora.dropout": "the JAX adapters have no dropout",
    },
    config_key="jax_cfg",
    config_block=JaxConfig,
    renamed={
        "jax_cfg.activation_checkpointing": "activation_checkpointing",
        "jax_cfg.fsdp_size": "parallel.fsdp_size",
        "jax_cfg.tensor_parallel_size": "parallel.tensor_parallel_size",
        "jax_cfg.context_parallel_size": "parallel.context_parallel_size",
        "jax_cfg.expert_parallel_size": "parallel.expert_parallel_size",
    },
    one_worker_per_device=False,
    optimizers=OPTIMIZERS,
    schedulers=SCHEDULERS,
    sliding_window_rows=True,
    checkpoint_format="orbax",
    optimizer_files=(),
    checks=_checks,
    layout_checks=_layout_checks,
    model_checks=_model_checks,
    driver_checks=_driver_checks,
    devices_per_worker=_devices_per_worker,
)
