"""The ``torch_fsdp`` backend's spec: PyTorch FSDP1 over every rank (data parallel only).

Imports only core (and the torch backends' shared spec): the driver validates a config
without importing torch.  Registered by the ``dualrl.backends`` entry point in pyproject.toml.
"""

from __future__ import annotations

from backends.torch_common.spec import TORCH_OPTIONS, lora_dropout_problems
from core.policy.backend_spec import BackendSpec

_NO_TP = "FSDP1 shards every parameter over all ranks and has no tensor-parallel mesh axis; use torch_dtensor"

SPEC = BackendSpec(
    name="torch_fsdp",
    worker="backends.torch_fsdp.worker:FSDP1PolicyWorker",
    layout_prefix="fsdp1",
    supports=TORCH_OPTIONS,
    why_not={
        "parallel.tensor_parallel_size": _NO_TP,
        "parallel.sequence_parallel": _NO_TP,
        "parallel.context_parallel_size": "FSDP1 has no context-parallel mesh axis; use torch_dtensor or jax_pjit",
        "parallel.expert_parallel_size": "expert parallelism is implemented on jax_pjit only",
        "compile": "per-block torch.compile is wired into the FSDP2 path only; use torch_dtensor",
        "make_vocab_size_divisible_by": (
            "FSDP1 has no tensor parallelism, so nothing needs a padded vocabulary; torch_dtensor and jax_pjit pad"
        ),
    },
    renamed={
        "activation_checkpointing_enabled": "activation_checkpointing",
        "fsdp_offload_enabled": "cpu_offload",
    },
    checks=lora_dropout_problems,
)
