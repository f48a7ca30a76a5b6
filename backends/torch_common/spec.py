"""What the two torch backends' specs share: the options every torch worker implements (the
micro-batch loop, HF activation checkpointing, LoRA, generation with HF ``generate``), and
their checks.  Imports only core: the driver reads it without importing torch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from core.config import Problem

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig

#: The options of ``core.policy.options`` both torch workers implement.
TORCH_OPTIONS = frozenset(
    {
        "activation_checkpointing",
        "cpu_offload",
        "sequence_packing.enabled",
        "sequence_packing.shared_prompts",
        "dynamic_batching.enabled",
        "lora.enabled",
        "lora.dropout",
        "generation.backend",
        "numerics",
    }
)


def lora_dropout_problems(policy: PolicyConfig) -> Iterable[Problem]:
    """Adapter dropout under a recomputing forward (activation checkpointing) would draw another
    mask in backward: torch's checkpoint restores the global RNG, not the adapters' generator."""
    if policy.lora.enabled and policy.lora.dropout > 0 and policy.activation_checkpointing:
        # Measured: tiny Llama, dropout 0.1, adapter gradients off by 0.22 (largest 0.83).
        yield (
            "lora.dropout",
            f"{policy.lora.dropout}: adapter dropout with policy.activation_checkpointing=true is not supported: the "
            "recomputed forward draws another mask (activation checkpointing restores torch's global RNG, not the "
            "adapters' own generator), so the gradients would not be those of the forward; set one of them off",
        )
