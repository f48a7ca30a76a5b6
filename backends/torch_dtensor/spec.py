"""The ``torch_dtensor`` backend's spec: FSDP2 ``fully_shard`` on a (dp, cp, tp) device mesh,
with tensor / sequence / context parallelism, and its own block ``policy.dtensor_cfg``.

Imports only core (and the torch backends' shared spec): the driver validates a config
without importing torch.  Registered by the ``dualrl.backends`` entry point in pyproject.toml.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from backends.torch_common.spec import TORCH_OPTIONS, lora_dropout_problems
from core.config import ConfigModel, Problem
from core.policy.backend_spec import BackendSpec

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig


class DTensorConfig(ConfigModel):
    """Settings only the ``torch_dtensor`` backend has (``policy.dtensor_cfg``)."""

    custom_parallel_plan: str | None = None
    """"module.path.PLAN" (a dict of module name -> ParallelStyle, or a function of the model
    returning one) overriding the built-in tensor-parallel plan."""


def _checks(policy: PolicyConfig) -> Iterable[Problem]:
    yield from lora_dropout_problems(policy)
    tp = policy.parallel.tensor_parallel_size
    if policy.lora.enabled and policy.lora.dropout > 0 and tp > 1:
        yield (
            "lora.dropout",
            f"{policy.lora.dropout}: adapter dropout with parallel.tensor_parallel_size={tp} is not supported on "
            "torch_dtensor; set it to 0",
        )


SPEC = BackendSpec(
    name="torch_dtensor",
    worker="backends.torch_dtensor.worker:DTensorPolicyWorker",
    layout_prefix="dtensor",
    supports=TORCH_OPTIONS
    | {
        "parallel.tensor_parallel_size",
        "parallel.sequence_parallel",
        "parallel.context_parallel_size",
        "compile",
        "make_vocab_size_divisible_by",
    },
    why_not={"parallel.expert_parallel_size": "expert parallelism is implemented on jax_pjit only"},
    config_key="dtensor_cfg",
    config_block=DTensorConfig,
    renamed={
        "dtensor_cfg.activation_checkpointing": "activation_checkpointing",
        "dtensor_cfg.cpu_offload": "cpu_offload",
        "dtensor_cfg.compile": "compile",
        "dtensor_cfg.tensor_parallel_size": "parallel.tensor_parallel_size",
        "dtensor_cfg.context_parallel_size": "parallel.context_parallel_size",
        "dtensor_cfg.sequence_parallel": "parallel.sequence_parallel",
    },
    checks=_checks,
)


def settings(policy: PolicyConfig) -> DTensorConfig:
    """``policy.dtensor_cfg`` (its defaults where the config has no such block)."""
    return policy.block(SPEC, DTensorConfig)
