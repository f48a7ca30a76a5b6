"""Loading HF causal LMs for training, and the checks that must fail before any work starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.refit.manifest import dtype_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ValueError(f"policy.precision must be one of {sorted(DTYPES)}, got {precision!r}")
    return DTYPES[precision]


def as_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or a name (``"bfloat16"``: the refit stream's dtype names)."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype_name(dtype))


def load_hf_model(model_name: str) -> PreTrainedModel:
    """``AutoModelForCausalLM`` by local path or hub name, in float32 on the host.

    Parameters stay float32 (the optimizer's master copy); ``policy.precision`` is applied as
    the *compute* dtype by each backend's mixed-precision policy, as NeMo RL does.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    model.config.use_cache = False  # training forwards never want a KV cache
    return model


def hf_param_meta(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF parameter name -> (full shape, dtype), recorded before any sharding."""
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
