"""The policy options a backend may or may not implement, each spelled once.

An option several backends have has one key in the ``policy`` section (``policy.
activation_checkpointing``, ``policy.parallel.tensor_parallel_size``, ...), whatever backend
runs it.  A backend's spec (:class:`core.policy.backend_spec.BackendSpec`) lists the options
it implements (``supports``); one that is asked for (:meth:`Option.asks`) on a backend that
lacks it is refused by name on the driver, with the backend's reason.  The same table gives
``docs/configuration.md`` its options x backends matrix (``tools/backend_table.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig


@dataclass(frozen=True)
class Option:
    """One policy option: where it lives, when it asks something of the backend, and the
    value that asks nothing (what a refusal says to set instead)."""

    key: str
    """Dotted path below ``policy`` (``parallel.tensor_parallel_size``)."""
    what: str
    """What it is, for messages and the docs table ("tensor parallelism")."""
    asks: Callable[[Any], bool]
    """Whether a value asks the backend for the feature (False: the feature stays off)."""
    off: str
    """The value that asks nothing, as a YAML literal."""
    within: str | None = None
    """A switch that must be on for the option to mean anything (``lora.enabled`` for the
    adapter dropout)."""

    def value(self, policy: PolicyConfig) -> Any:
        node: Any = policy
        for part in self.key.split("."):
            node = None if node is None else getattr(node, part)  # a null section asks nothing
        return node

    def asked(self, policy: PolicyConfig) -> bool:
        if self.within is not None and not option(self.within).asked(policy):
            return False
        return bool(self.asks(self.value(policy)))


def _on(value: Any) -> bool:
    return bool(value)


def _above_one(value: Any) -> bool:
    return value is not None and value > 1


def _above_zero(value: Any) -> bool:
    return value is not None and value > 0


def _policy_generation(backend: Any) -> bool:
    return backend == "hf"


def _exact(numerics: Any) -> bool:
    return numerics == "exact"


#: Every option a backend may lack, in the order of the docs table.
OPTIONS: tuple[Option, ...] = (
    Option("parallel.tensor_parallel_size", "tensor parallelism", _above_one, "1"),
    Option("parallel.sequence_parallel", "sequence parallelism", _on, "false"),
    Option("parallel.context_parallel_size", "context parallelism", _above_one, "1"),
    Option("parallel.expert_parallel_size", "expert parallelism", _above_one, "1"),
    Option("activation_checkpointing", "activation checkpointing", _on, "false"),
    Option("cpu_offload", "CPU offload", _on, "false"),
    Option("compile", "torch.compile of each transformer block", _on, "false"),
    Option("make_vocab_size_divisible_by", "vocabulary padding", _above_one, "1"),
    Option("sequence_packing.enabled", "sequence packing", _on, "false"),
    Option("sequence_packing.shared_prompts", "shared-prompt packing", _on, "false", within="sequence_packing.enabled"),
    Option("dynamic_batching.enabled", "dynamic batching", _on, "false"),
    Option("lora.enabled", "LoRA adapters", _on, "false"),
    Option("lora.dropout", "LoRA adapter dropout", _above_zero, "0", within="lora.enabled"),
    Option("generation.backend", "generation on the policy workers", _policy_generation,
           "vllm"),
    Option("numerics", "batch-invariant exact numerics", _exact, "default"),
)  # fmt: skip
OPTION_KEYS = frozenset(o.key for o in OPTIONS)


def option(key: str) -> Option:
    """The option at ``key`` (KeyError naming the known keys otherwise)."""
    for opt in OPTIONS:
        if opt.key == key:
            return opt
    raise KeyError(f"{key!r} is not a policy option; known: {sorted(OPTION_KEYS)}")
