"""Which submodules of an HF causal LM are its transformer blocks (the unit of sharding)."""

from __future__ import annotations

import torch


def decoder_layer_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The classes named by the model's ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``).

    HF declares there which modules must stay whole on one device, which is exactly the
    granularity FSDP should wrap and activation checkpointing should recompute.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"cannot find the transformer block class of {type(model).__name__}: its _no_split_modules "
            f"{sorted(names)} match no submodule"
        )
    return classes


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    classes = tuple(decoder_layer_classes(model))
    return [m for m in model.modules() if isinstance(m, classes)]
