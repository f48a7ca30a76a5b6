"""``policy.numerics``: what exact mode (batch-invariant numerics, ``core.kernels.exact``)
covers, and the refusals of what it does not, on the driver before any worker starts.

Exact mode promises that the sampler's logprob of every sampled token equals the trainer's
bit for bit; a layout that would break that silently is refused by name rather than run
"approximately exact".  The refusals are one table (:data:`EXACT_REFUSALS`, config keys)
and one model check (:func:`check_exact_model`), so a backend spec can take them over.
Exact mode itself is a backend capability, the option ``numerics`` of
``core.policy.options``: a backend whose spec does not list it in ``supports`` is refused by
name like any option it lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from core.policy.options import option

if TYPE_CHECKING:
    from core.config import Problem
    from core.policy.config import PolicyConfig

Numerics = Literal["default", "exact"]
#: HF ``model_type`` values with exact layers on every backend (dense, full attention).
EXACT_MODEL_TYPES = ("llama", "qwen2", "qwen3")

_SPLITS_ROWS = "splits a row's reductions over devices"


class Refusal(NamedTuple):
    """A setting exact mode refuses: its key under ``policy``, when it applies, why."""

    key: str
    applies: Callable[[PolicyConfig], bool]
    why: str


def _asked(key: str) -> Callable[[PolicyConfig], bool]:
    """Whether the policy option at ``key`` (``core.policy.options``) asks for its feature."""
    return lambda policy: option(key).asked(policy)


#: The policy options (``core.policy.options``) exact mode refuses when they are asked for.
_REFUSED_OPTIONS = {
    "parallel.tensor_parallel_size": f"tensor parallelism {_SPLITS_ROWS}",
    "parallel.sequence_parallel": f"sequence parallelism {_SPLITS_ROWS}",
    "parallel.context_parallel_size": f"context parallelism {_SPLITS_ROWS}",
    "parallel.expert_parallel_size": "mixtures of experts have no exact layers",
    "compile": "torch.compile fuses the exact layers into kernels of its own",
    "sequence_packing.enabled": "packed rows have no exact attention (positions restart inside a row)",
    "lora.enabled": "LoRA adapters have no exact layers",
}

EXACT_REFUSALS: tuple[Refusal, ...] = (
    Refusal("precision", lambda p: p.precision == "float16", "exact layers exist for float32 and bfloat16"),
    *(Refusal(key, _asked(key), why) for key, why in _REFUSED_OPTIONS.items()),
    Refusal(
        "generation.backend",
        lambda p: p.generation is not None and p.generation.backend != "hf",
        "vLLM's kernels are not the trainer's; exact mode samples with generation.backend 'hf' "
        "(the policy's own exact model; docs/exact-numerics.md says why vLLM cannot be exact here)",
    ),
)


def exact_numerics_problems(policy: PolicyConfig) -> Iterable[Problem]:
    """``(key, message)`` for every setting exact mode refuses (none unless ``numerics: exact``)."""
    if policy.numerics != "exact":
        return
    for refusal in EXACT_REFUSALS:
        if refusal.applies(policy):
            yield refusal.key, f"{_value(policy, refusal.key)!r} is refused with numerics 'exact': {refusal.why}"


def _value(policy: Any, key: str) -> Any:
    for part in key.split("."):
        policy = getattr(policy, part)
    return policy


def check_exact_model(model_config: Any, policy: PolicyConfig) -> None:
    """Refuse a model exact mode has no layers for (ValueError naming ``policy.numerics``)."""
    if policy.numerics != "exact":
        return
    model_type = getattr(model_config, "model_type", None)
    why = None
    if model_type not in EXACT_MODEL_TYPES:
        why = f"model_type {model_type!r} has no exact layers (they exist for {', '.join(EXACT_MODEL_TYPES)})"
    elif getattr(model_config, "hidden_act", "silu") != "silu":
        why = f"hidden_act {model_config.hidden_act!r} has no exact layer (only silu)"
    elif "sliding_attention" in (getattr(model_config, "layer_types", None) or ()):
        why = "sliding-window layers have no exact attention"
    elif getattr(model_config, "attention_bias", False) or getattr(model_config, "mlp_bias", False):
        why = "attention_bias / mlp_bias have no exact layers"
    if why:
        raise ValueError(f"policy.numerics='exact': {why}; use numerics 'default' for this model")
