"""What a refit carries: HF tensor names with full shapes and the generation dtype.

The policy states it once (``prepare_refit_info``) before any bytes move; the engine checks
it against the model it serves, and then checks every bucket against it.  Dtypes travel as
names (``"bfloat16"``), never as torch/numpy objects, so the manifest crosses Ray and vLLM's
RPC unchanged and means the same thing to torch and JAX senders.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: transformers 5 state-dict names of experts fused into one tensor (``mlp.experts.gate_up_proj``:
#: no expert index), where checkpoints name one tensor per expert (``mlp.experts.3.gate_proj.weight``).
FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]+$")

#: What one refit stream carries: every weight (LoRA merged), or -- adapter-only LoRA refit --
#: the unmerged base weights (once per engine) or the adapters alone.
RefitPart = Literal["full", "base", "adapter"]
REFIT_PARTS = ("full", "base", "adapter")

# Bytes per element of every dtype a refit stream may carry.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class RefitError(RuntimeError):
    """A refit was refused or failed; the message names the tensor and what is wrong."""


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``np.dtype('float32')`` / ``jnp.bfloat16`` / ``"bf16"`` -> ``"bfloat16"``."""
    if isinstance(dtype, type):  # scalar types: np.float32, jnp.bfloat16, ml_dtypes.bfloat16
        import numpy as np

        try:
            dtype = np.dtype(dtype)
        except TypeError:
            pass
    text = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    text = {
        "bf16": "bfloat16",
        "fp32": "float32",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
        "double": "float64",
    }.get(text, text)
    if text not in DTYPE_BYTES:
        raise RefitError(f"dtype {dtype!r} cannot be refit; supported: {sorted(DTYPE_BYTES)}")
    return text


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class RefitManifest:
    """Ordered ``hf_name -> TensorSpec``; the order is the order the stream yields.

    ``optional`` names may be left out of a stream that is checked against this manifest:
    aliases such as a tied ``lm_head.weight``, which some exporters write and others do not.
    """

    def __init__(
        self, specs: Mapping[str, TensorSpec], optional: Iterable[str] = (), aliases: Mapping[str, str] | None = None
    ) -> None:
        self.specs = dict(specs)
        self.optional = frozenset(optional)
        #: optional name -> the tensor it is tied to (``lm_head.weight`` -> ``model.embed_tokens.weight``)
        self.aliases = dict(aliases or {})

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> RefitManifest:
        """From ``{name: (shape, dtype)}`` (``prepare_refit_info``'s form) or a manifest."""
        if isinstance(info, RefitManifest):
            return info
        if not isinstance(info, Mapping) or not info:
            raise RefitError(
                f"refit info must be a non-empty mapping name -> (shape, dtype), got {type(info).__name__}"
            )
        specs = {}
        for name, value in info.items():
            try:
                shape, dtype = value
                specs[str(name)] = TensorSpec(tuple(int(d) for d in shape), dtype_name(dtype))
            except (TypeError, ValueError) as exc:
                raise RefitError(f"refit info for {name!r} must be (shape, dtype), got {value!r}") from exc
            except RefitError as exc:  # an unsupported dtype: say which tensor has it
                raise RefitError(f"refit info for {name!r}: {exc}") from None
        return cls(specs)

    def to_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (s.shape, s.dtype) for n, s in self.specs.items()}

    def cast(self, dtype: Any) -> RefitManifest:
        """The same tensors in another dtype (training dtype -> generation dtype)."""
        name = dtype_name(dtype)
        return RefitManifest({n: TensorSpec(s.shape, name) for n, s in self.specs.items()})

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __getitem__(self, name: str) -> TensorSpec:
        return self.specs[name]

    def check_against(self, expected: RefitManifest, what: str = "engine") -> None:
        """Refuse a manifest that does not describe exactly the tensors ``expected`` holds.

        Runs before any weight is touched, so a wrong model, a wrong dtype or a renamed
        parameter fails the refit while the engine still has its previous weights.
        """
        problems = _first(
            f"unknown tensor {n!r}: the {what} has no such weight" for n in self.specs if n not in expected
        )
        problems += _first(
            f"{n!r}: stream shape {list(s.shape)} but the {what} expects {list(expected[n].shape)}"
            for n, s in self.specs.items()
            if n in expected and s.shape != expected[n].shape
        )
        problems += _first(
            f"{n!r}: stream dtype {s.dtype} but the {what} serves {expected[n].dtype}"
            for n, s in self.specs.items()
            if n in expected and s.dtype != expected[n].dtype
        )
        problems += _first(
            f"missing tensor {n!r}: the stream would leave it stale"
            for n in expected.specs
            if n not in self.specs and n not in expected.optional
        )
        if problems:
            raise RefitError("refit manifest does not match the " + what + ": " + "; ".join(problems))


def _first(messages: Iterable[str], limit: int = 3) -> list[str]:
    """At most ``limit`` messages plus a count of the rest (a wrong model lists hundreds)."""
    out = list(messages)
    if len(out) > limit:
        return out[:limit] + [f"... and {len(out) - limit} more like it"]
    return out


def manifest_for_hf_config(hf_config: Any, dtype: Any) -> RefitManifest:
    """The checkpoint-format tensors a model of ``hf_config`` holds, in ``dtype``.

    Built on the meta device (no memory): the names and shapes an HF checkpoint of this
    model has, which is what an engine loading checkpoint-format weights expects.  Tied
    aliases (in the state dict but not separate parameters) are optional.

    Models whose experts transformers fuses in memory (Qwen3-MoE: ``mlp.experts.gate_up_proj``)
    are listed in the checkpoint format all the same, one tensor per expert, through
    transformers' own reverse conversion (what ``save_pretrained`` writes): the format vLLM's
    ``load_weights`` reads, the JAX backend streams, and the torch backends stream after
    ``core.refit.checkpoint_names`` splits the fused tensors.  (Streaming the fused tensors
    unsplit had vLLM take them without error and generate from wrong weights:
    token_mult_prob_error 4.7 on a tiny Qwen3-MoE.)
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    optional = [n for n in state if n not in params]
    if any(FUSED_EXPERTS.search(n) for n in state):
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, dict(state))
        fused = [n for n in state if FUSED_EXPERTS.search(n)]
        if fused:  # a fused layout transformers does not convert back: no per-expert names to offer
            raise RefitError(
                f"refit of model_type {getattr(hf_config, 'model_type', None)!r} into vLLM is not supported: "
                f"transformers holds {fused[0]!r} fused and has no checkpoint format for it"
            )
    name = dtype_name(dtype)
    specs = {n: TensorSpec(tuple(t.shape), name) for n, t in state.items()}
    return RefitManifest(specs, optional=optional, aliases=tied_aliases(model))


def tied_aliases(model: Any) -> dict[str, str]:
    """State-dict names of a torch module that are the same Parameter as an earlier name
    (a tied ``lm_head.weight`` -> ``model.embed_tokens.weight``): the refit stream leaves
    them out (the engine's receiver fills them in), so a tied weight is not sent twice."""
    state = model.state_dict(keep_vars=True)  # the Parameters themselves: tied names share one object
    owner = {id(p): n for n, p in model.named_parameters()}  # de-duplicated: the first name owns
    return {n: owner[id(t)] for n, t in state.items() if id(t) in owner and owner[id(t)] != n}
