"""``ModelConfig``: the architecture a JAX model is built from, one dataclass for every family.

A family module (``llama``, ...) reads an HF config into it (``config_from_hf`` in the registry,
``backends.jax_pjit.models``, picks the module), refusing the options it does not implement;
the checks that hold for every family (RoPE type, head grouping, padded vocabulary) live here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

#: RoPE variants ``layers.rope_inv_freq`` implements (HF ``rope_parameters["rope_type"]``).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _freeze(value: Any) -> Any:
    """Make a config value hashable (lists -> tuples) so ``ModelConfig`` can be a jit static."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a model of a supported family (hashable: usable as a ``jax.jit`` static).

    ``family`` names the row of the registry (``backends.jax_pjit.models``) whose module
    builds the model; ``backends.jax_pjit.models.config_from_hf`` reads an HF config through
    that module (this module does not import the registry: the registry imports it).

    ``rope_scaling`` is HF's ``config.rope_parameters`` (``rope_type``, ``rope_theta`` and
    the type's parameters).  A dict may be passed; it is stored as sorted ``(key, value)``
    pairs to keep the dataclass hashable, and read back with ``rope_parameters``.
    """

    #: RoPE types this family's model implements (a family subclass may widen it).
    supported_rope_types: ClassVar[tuple[str, ...]] = SUPPORTED_ROPE_TYPES

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    #: Qwen3: RMSNorm over ``head_dim`` of every query / key head (own scales per layer),
    #: applied after the projection and before RoPE (HF ``q_norm`` / ``k_norm``).
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    #: Embedding rows / lm_head columns the model *stores* (>= ``vocab_size``; None =
    #: ``vocab_size``): tensor parallelism shards the vocabulary, so a vocabulary ``tp`` does
    #: not divide is padded with zeros (``core.policy.vocab_padding``).  The padded
    #: logits are masked in ``CausalLM._logits``; ``vocab_size`` stays the real vocabulary,
    #: and everything leaving the backend (HF export, refit, logprobs) has that many rows.
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        padded = self.vocab_size if self.padded_vocab_size is None else self.padded_vocab_size
        object.__setattr__(self, "padded_vocab_size", padded)
        if padded < self.vocab_size:
            raise ValueError(f"padded_vocab_size={padded} < vocab_size={self.vocab_size}")
        rope = dict(self.rope_scaling or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope.setdefault("rope_theta", self.rope_theta)
        object.__setattr__(self, "rope_scaling", tuple(sorted((k, _freeze(v)) for k, v in rope.items())))
        object.__setattr__(self, "rope_theta", float(rope["rope_theta"]))
        if self.rope_type not in self.supported_rope_types:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; the JAX {self.family} model implements "
                f"{self.supported_rope_types}"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported by the JAX model")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        return self.rope_parameters["rope_type"]

    @property
    def is_vocab_padded(self) -> bool:
        return self.padded_vocab_size != self.vocab_size

    def with_padded_vocab(self, tp: int = 1, make_divisible_by: int = 1) -> ModelConfig:
        """This config with the vocabulary padded for ``tp``-way sharding (and to a multiple of
        ``make_divisible_by``): ``core.policy.vocab_padding.padded_vocab_size``."""
        from core.policy.vocab_padding import padded_vocab_size

        return dataclasses.replace(self, padded_vocab_size=padded_vocab_size(self.vocab_size, tp, make_divisible_by))

    def unpadded(self) -> ModelConfig:
        """This config as the HF checkpoint describes it (``padded_vocab_size = vocab_size``)."""
        return dataclasses.replace(self, padded_vocab_size=self.vocab_size)


__all__ = ["ModelConfig", "SUPPORTED_ROPE_TYPES"]
