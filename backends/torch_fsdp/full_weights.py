"""Full weights of an FSDP1 model, one FSDP unit at a time (refit, HF export, generation).

FSDP1 communicates a unit's parameters as one flat parameter, so the unit (one transformer
block, or the root's embeddings + final norm + lm_head) is the smallest gather there is.
``FSDP.summon_full_params(unit, recurse=False)`` gathers exactly that unit; each of its
weights is copied out and the unit is freed before the next one is gathered.  Peak extra
memory is one unit plus what the consumer still holds, instead of the whole model that a
full state dict materialises (and on CPU no ``offload_to_cpu``, which segfaults there).

The stream's order is the units' order (root first: its lazy initialisation must run
before any inner unit is touched), so the refit manifest lists names in that order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from backends.torch_common.torch_private import FSDP_WRAPPED_MODULE, unit_weight_records


def hf_name(*parts: str) -> str:
    """Join name parts and drop FSDP's wrapper segments: the HF state-dict name."""
    return ".".join(p for part in parts if part for p in part.split(".") if p != FSDP_WRAPPED_MODULE)


class UnitPlan:
    """Which FSDP unit holds which HF-named weight, in stream order."""

    def __init__(self, model: FSDP, names: Mapping[str, object]) -> None:
        """``names``: every HF name the stream must carry (the model's state-dict keys)."""
        # Each unit's own weights (a nested unit's are its own) from its flat parameter's
        # records, not ``named_parameters``: FSDP1 (use_orig_params) leaves a unit whose weights
        # are all frozen (LoRA's root: embeddings, norm, head) holding plain-tensor views after
        # a training forward, which ``named_parameters`` no longer lists.
        self.units: list[tuple[FSDP, list[tuple[str, str, torch.nn.Module, str]]]] = []
        for path, module in model.named_modules():
            if isinstance(module, FSDP):
                own = [(hf_name(path, raw), raw, owner, attr) for raw, owner, attr in _unit_weights(module)]
                self.units.append((module, [(raw, name, owner, attr) for name, raw, owner, attr in own]))
        covered = {name for _, own in self.units for _, name, _, _ in own}
        # Weights FSDP does not shard (persistent buffers) are read where they live.
        self.buffers = {hf_name(n): b for n, b in model.named_buffers() if hf_name(n) in names}
        unknown = set(names) - covered - set(self.buffers)
        if unknown:
            raise RuntimeError(f"FSDP1 full-weight plan: state-dict names {sorted(unknown)} are held by no FSDP unit")
        self.order = [name for _, own in self.units for _, name, _, _ in own if name in names] + sorted(self.buffers)

    def iter_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(hf_name, full tensor)`` in ``self.order`` minus ``skip``, each a
        fresh copy (the gathered storage is freed when its unit is left)."""
        for unit, own in self.units:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                for _, name, owner, attr in own:
                    if name not in skip:
                        yield name, _copy(getattr(owner, attr), dtype)
        for name in sorted(set(self.buffers) - skip):
            yield name, _copy(self.buffers[name], dtype)


def _copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.detach().to(dtype=dtype or t.dtype, copy=True)


def _unit_weights(unit: FSDP) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name under the unit's module, owning module, attribute)`` of every original weight
    the unit's flat parameter holds, tied aliases included (HF state-dict order)."""
    records = unit_weight_records(unit)
    return [(f"{mod}.{attr}" if mod else attr, owner, attr) for mod, owner, attr in records]
