"""Fused expert tensors in the checkpoint format vLLM loads: one tensor per expert.

transformers 5 holds a Qwen2-MoE-style model's experts fused in memory (its conversion
mapping "qwen2_moe": Qwen3-MoE, Qwen2-MoE, OLMoE, ...): ``mlp.experts.gate_up_proj`` [E, 2I,
H], each expert's ``gate_proj`` rows then its ``up_proj`` rows, and ``mlp.experts.down_proj``
[E, H, I].  Checkpoints, vLLM's ``load_weights`` and the JAX backend's weight table name one
tensor per expert (``mlp.experts.3.gate_proj.weight`` [I, H]).  The torch backends' refit
stream goes through :func:`checkpoint_weights`, which splits the fused tensors as they pass
(views, no copy), and announces the split names (:func:`checkpoint_refit_info`); the engine's
manifest lists the same names (``manifest_for_hf_config``, from transformers' own reverse
conversion), so a layout this module does not know is refused by the manifest check, by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = ["checkpoint_refit_info", "checkpoint_weights", "fused_expert_names"]

_FUSED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
Meta = TypeVar("Meta")


def fused_expert_names(names: Iterable[str]) -> list[str]:
    """The names among ``names`` of transformers' fused expert tensors."""
    return [n for n in names if _FUSED.match(n)]


def _split_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int, slice]]:
    """``(checkpoint name, its shape, expert, rows)`` of each part of ``name`` (one part, the
    name itself, when it is not fused)."""
    match = _FUSED.match(name)
    if match is None:
        return [(name, shape, -1, slice(None))]
    if len(shape) != 3:
        raise ValueError(f"fused expert tensor {name!r} has shape {shape}, expected [experts, out, in]")
    prefix, experts, rows, cols = match["experts"], shape[0], shape[1], shape[2]
    if match["kind"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (rows, cols), e, slice(None)) for e in range(experts)]
    if rows % 2:
        raise ValueError(f"fused expert tensor {name!r}: {rows} rows cannot be gate_proj + up_proj halves")
    half = rows // 2
    return [
        (f"{prefix}.{e}.{part}.weight", (half, cols), e, slice(start, start + half))
        for e in range(experts)
        for part, start in (("gate_proj", 0), ("up_proj", half))
    ]


def checkpoint_refit_info(info: Mapping[str, tuple[tuple[int, ...], Meta]]) -> dict[str, tuple[tuple[int, ...], Meta]]:
    """``prepare_refit_info``'s name -> (shape, dtype) with fused experts split, in stream order."""
    out: dict[str, tuple[tuple[int, ...], Meta]] = {}
    for name, (shape, dtype) in info.items():
        for part, part_shape, _, _ in _split_names(name, tuple(shape)):
            out[part] = (part_shape, dtype)
    return out


def checkpoint_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A refit stream with each fused expert tensor replaced by its experts' tensors."""
    for name, tensor in weights:
        for part, _, expert, rows in _split_names(name, tuple(tensor.shape)):
            yield part, tensor if expert < 0 else tensor[expert, rows]
